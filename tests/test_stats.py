"""The interval behind every speedup: its coverage at the few rounds a benchmark runs, simulated on
known distributions (ablate.analysis.coverage), and its answers where it cannot claim anything."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ablate.analysis.coverage import MODELS, coverage, percentile_bootstrap
from ablate.analysis.stats import MIN_ROUNDS, coefficient_of_variation, log_interval, log_ratio_interval


def t_interval(ratios: np.ndarray) -> tuple[float, float]:
    interval = log_interval(ratios)
    return interval.low, interval.high


# 2000 trials each: 3 rounds, the fewest an interval is given for, in the default run; 5 and 10 slow (CI runs them)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("rounds", [3, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 10))])
def test_coverage_is_within_a_few_points_of_nominal(model, rounds):
    achieved = coverage(t_interval, model, rounds, trials=2000, seed=rounds)
    # 2000 trials: standard error 0.5 points; stalls are not symmetric-normal and over-cover a little
    assert 0.92 <= achieved <= (0.985 if model == "stalls" else 0.975), f"{model} n={rounds}: {achieved:.3f}"


def test_the_old_percentile_bootstrap_under_covers_at_three_rounds():
    """What this interval replaced: the issue measured 74% at n=3; the check must be able to fail."""
    assert coverage(percentile_bootstrap, "lognormal", 3, trials=400) < 0.85


def test_centre_is_the_geometric_mean_and_the_interval_contains_it():
    values = np.array([1.8, 2.0, 2.2, 1.9, 2.1])
    interval = log_interval(values)
    assert interval.center == pytest.approx(math.exp(np.log(values).mean()))
    assert interval.low < interval.center < interval.high and interval.n == 5 and interval.is_supported
    assert log_interval(values, confidence=0.99).low < interval.low          # wider at higher confidence
    assert interval.excludes(1.0) and not interval.excludes(2.0)
    assert interval.text() == f"{interval.center:.2f}x [{interval.low:.2f}, {interval.high:.2f}]"


@pytest.mark.parametrize("n", range(1, MIN_ROUNDS))
def test_too_few_rounds_give_no_interval_and_say_why(n):
    interval = log_interval(np.full(n, 1.67))
    assert interval.center == pytest.approx(1.67) and math.isnan(interval.low) and math.isnan(interval.high)
    assert not interval.is_supported and not interval.excludes(1.0)
    assert interval.text() == f"1.67x [n/a: {n} round{'s' * (n > 1)}, an interval needs 3]"


def test_degenerate_inputs():
    assert log_interval(np.full(4, 1.7)).low == pytest.approx(1.7)       # no spread: a zero-width interval
    assert log_interval([np.nan, 2.0, np.nan, 2.0, 2.0]).n == 3           # NaNs are dropped
    empty = log_interval([])
    assert empty.n == 0 and empty.note == "no values" and empty.text() == "n/a (no values)"
    assert log_interval([1.0, 0.0, 2.0]).note == "a value <= 0 has no log"


def test_two_independent_samples():
    a, b = np.array([1.0, 1.1, 0.95, 1.05]), np.array([2.0, 2.1, 1.9, 2.05])
    interval = log_ratio_interval(a, b)
    assert interval.center == pytest.approx(np.exp(np.log(b).mean() - np.log(a).mean()))
    assert interval.low > 1.7 and interval.high < 2.3
    assert log_ratio_interval(np.zeros(3), np.zeros(3)).center == 1.0       # nothing on both sides: the same
    assert not log_ratio_interval(a[:2], b[:2]).is_supported
    assert log_ratio_interval(np.full(3, 2.0), np.full(3, 3.0)).low == pytest.approx(1.5)


def test_coefficient_of_variation():
    assert coefficient_of_variation(np.array([1.0, 1.0, 1.0])) == 0.0
    assert coefficient_of_variation(np.array([9.0, 11.0])) == pytest.approx(np.sqrt(2) / 10)
    assert np.isnan(coefficient_of_variation(np.array([4.0])))
