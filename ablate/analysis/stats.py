"""Statistics of repeated measurements: intervals that hold at the few rounds a benchmark can afford.

A speedup, or any positive figure measured once per round, is summarised on the log scale:

    x_r > 0 (r = 1 .. n),  y_r = log x_r,  ybar = mean(y),  s = std(y, ddof=1)
    centre = exp(ybar)                                       the geometric mean
    CI     = exp(ybar -/+ t_{1 - alpha/2, n - 1} * s / sqrt(n))

Why this interval: the log of a paired ratio of two run times is close to symmetric (the difference
of two alike noises; drift of a shared machine cancels within a round), and a t-interval of a
symmetric quantity keeps its coverage at n = 3, where the percentile bootstrap of the median
covered 74% at a nominal 95%. Coverage is simulated in tests/test_stats.py and tabled by
`python benchmarks/interval_coverage.py`. Below MIN_ROUNDS no interval is claimed: the result says
"n/a" and why.

Two runs compared (`log_ratio_interval`): Welch's t on the two samples of logs, so neither run's
rounds are assumed to pair with the other's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

MIN_ROUNDS = 3      # fewer values give no interval: with 2 the t-interval's width rests on one difference
CONFIDENCE = 0.95
NOISY_CV = 0.10     # a coefficient of variation above this makes an arm's figures untrustworthy


@dataclass(frozen=True)
class Interval:
    """A centre and its confidence interval; `note` says why there is none (low and high NaN)."""

    center: float
    low: float
    high: float
    n: int
    note: str = ""

    @property
    def is_supported(self) -> bool:
        """The interval exists (enough finite values)."""
        return bool(np.isfinite([self.center, self.low, self.high]).all())

    def excludes(self, value: float = 1.0) -> bool:
        """The interval supports a difference from `value` (False when there is no interval)."""
        return self.is_supported and (self.low > value or self.high < value)

    @property
    def relative_half_width(self) -> float:
        """sqrt(high / low) - 1: half the interval's width as a fraction of its centre (log scale)."""
        return math.sqrt(self.high / self.low) - 1 if self.is_supported and self.low > 0 else math.inf

    def text(self, unit: str = "x", digits: int = 2) -> str:
        """'1.87x [1.80, 1.95]', or '1.87x [n/a: 2 rounds, need 3]'."""
        if not np.isfinite(self.center):
            return f"n/a ({self.note})" if self.note else "n/a"
        bounds = f"{self.low:.{digits}f}, {self.high:.{digits}f}" if self.is_supported else f"n/a: {self.note}"
        return f"{self.center:.{digits}f}{unit} [{bounds}]"


def _clean(values) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return values[np.isfinite(values)]


def log_interval(values, confidence: float = CONFIDENCE) -> Interval:
    """Geometric mean of positive values and its t-interval on the log scale (module docstring)."""
    values = _clean(values)
    n = int(values.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "no values")
    if (values <= 0).any():
        return Interval(math.nan, math.nan, math.nan, n, "a value <= 0 has no log")
    logs = np.log(values)
    center = float(np.exp(logs.mean()))
    if n < MIN_ROUNDS:
        return Interval(center, math.nan, math.nan, n, f"{n} round{'s' * (n != 1)}, an interval needs {MIN_ROUNDS}")
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, n - 1) * logs.std(ddof=1) / math.sqrt(n))
    return Interval(center, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half)), n)


def log_ratio_interval(a, b, confidence: float = CONFIDENCE) -> Interval:
    """geomean(b) / geomean(a) with Welch's t-interval on the difference of mean logs (independent
    samples, unequal variances; Welch-Satterthwaite degrees of freedom)."""
    a, b = _clean(a), _clean(b)
    n = int(min(a.size, b.size))
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "no values")
    if not a.any() and not b.any():        # zero on both sides (e.g. no KV cache in either): the same
        return Interval(1.0, 1.0, 1.0, n)
    if (a <= 0).any() or (b <= 0).any():
        return Interval(math.nan, math.nan, math.nan, n, "a value <= 0 has no log")
    la, lb = np.log(a), np.log(b)
    center = float(np.exp(lb.mean() - la.mean()))
    if n < MIN_ROUNDS:
        return Interval(center, math.nan, math.nan, n, f"{n} repeat{'s' * (n != 1)} on a side, an interval needs "
                        f"{MIN_ROUNDS}")
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    if va + vb == 0:
        return Interval(center, center, center, n)
    df = (va + vb) ** 2 / (va**2 / (la.size - 1) + vb**2 / (lb.size - 1))
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, df) * math.sqrt(va + vb))
    return Interval(center, center * math.exp(-half), center * math.exp(half), n)


def coefficient_of_variation(values) -> float:
    values = np.asarray(values, dtype=float)
    if values.size < 2 or values.mean() == 0:
        return np.nan
    return float(values.std(ddof=1) / values.mean())
