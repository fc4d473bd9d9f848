"""Statistics of repeated measurements: medians, bootstrap confidence intervals, noise."""
from __future__ import annotations

import numpy as np

NOISY_CV = 0.10    # a coefficient of variation above this makes an arm's figures untrustworthy


def bootstrap_ci(values: np.ndarray, stat=np.median, confidence: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap: resample the values with replacement, take the statistic's quantiles."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return (np.nan, np.nan)
    if values.size == 1:
        return (float(values[0]), float(values[0]))
    rng = np.random.default_rng(seed)
    samples = rng.choice(values, size=(resamples, values.size), replace=True)
    stats = stat(samples, axis=1)
    alpha = (1 - confidence) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def ratio_summary(ratios: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Median and 95% CI of per-repeat-pair ratios."""
    lo, hi = bootstrap_ci(ratios, seed=seed)
    return {"median": float(np.nanmedian(ratios)) if len(ratios) else np.nan, "ci_low": lo, "ci_high": hi,
            "n": int(np.sum(~np.isnan(ratios)))}


def coefficient_of_variation(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=float)
    if values.size < 2 or values.mean() == 0:
        return np.nan
    return float(values.std(ddof=1) / values.mean())
