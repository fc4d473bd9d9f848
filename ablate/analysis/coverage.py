"""How often an interval method covers the truth, on simulated per-round speedups of known
distribution: the check behind ablate.analysis.stats (tests/test_stats.py) and its table
(benchmarks/interval_coverage.py).

Each model draws the log of a per-round ratio baseline time / arm time, with true speedup
exp(E[log ratio]) = 2 (the geometric mean, what `log_interval` estimates):

  lognormal     log ratio ~ N(log 2, 0.1^2)
  laplace       log ratio ~ log 2 + Laplace(0, 0.05): heavier tails than normal
  gamma-jitter  times 2 (1 + G_b), 1 (1 + G_a), G ~ Gamma(2, 0.05): each run is slowed by a
                right-skewed amount (interrupts, cache misses), independently
  stalls        times 2 (1 + e_b + 0.3 S_b), 1 (1 + e_a + 0.3 S_a), e ~ N(0, 0.02^2), S ~ Bernoulli(0.1):
                one run in ten stalls by 30%
A drift of the machine shared by both arms of a round multiplies both times and cancels in the ratio,
so it needs no model of its own.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

TRUE_SPEEDUP = 2.0


def _times_ratio(rng: np.random.Generator, shape, noise: Callable[[tuple], np.ndarray]) -> np.ndarray:
    return np.log(2 * (1 + noise(shape)) / (1 * (1 + noise(shape))))


MODELS: dict[str, Callable[[np.random.Generator, tuple], np.ndarray]] = {
    "lognormal": lambda rng, shape: rng.normal(np.log(TRUE_SPEEDUP), 0.1, shape),
    "laplace": lambda rng, shape: np.log(TRUE_SPEEDUP) + rng.laplace(0, 0.05, shape),
    "gamma-jitter": lambda rng, shape: _times_ratio(rng, shape, lambda s: rng.gamma(2, 0.05, s)),
    "stalls": lambda rng, shape: _times_ratio(
        rng, shape, lambda s: rng.normal(0, 0.02, s) + 0.3 * (rng.random(s) < 0.1)),
}


def true_log_speedup(model: str, draws: int = 2_000_000, seed: int = 12345) -> float:
    """E[log ratio] of a model: exact for the symmetric ones, by a large simulation for the others."""
    if model in ("lognormal", "laplace"):
        return float(np.log(TRUE_SPEEDUP))
    return float(MODELS[model](np.random.default_rng(seed), (draws,)).mean())   # the noise cancels on average


def coverage(method: Callable[[np.ndarray], tuple[float, float]], model: str, rounds: int, trials: int,
             seed: int = 0) -> float:
    """Fraction of `trials` simulated experiments of `rounds` rounds whose interval, from
    method(ratios) -> (low, high), contains the true speedup."""
    rng = np.random.default_rng(seed)
    truth = np.exp(true_log_speedup(model))
    ratios = np.exp(MODELS[model](rng, (trials, rounds)))        # (trials, rounds)
    hits = 0
    for row in ratios:
        low, high = method(row)
        hits += bool(low <= truth <= high)
    return hits / trials


def percentile_bootstrap(ratios: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The interval ablate used before: percentile bootstrap of the median (for comparison only)."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(ratios, size=(resamples, ratios.size)), axis=1)
    low, high = np.quantile(medians, [0.025, 0.975])
    return float(low), float(high)
