"""`python -m ablate compare <run> <run>`: two runs side by side, and whether they differ beyond noise.

For each grid point x arm present in both, and each metric, the ratio of medians B / A with a
bootstrap 95% CI (resampling each run's repeats independently); a difference is beyond noise
when the CI excludes 1.
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from ablate.results import load

METRICS = ("duration_s", "output_throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "peak_memory_bytes",
           "kv_reserved_peak_bytes")


def ratio_ci(a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(b) / median(a) and its percentile-bootstrap 95% CI."""
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if not a.size or not b.size or np.median(a) == 0:
        return (np.nan, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, (resamples, a.size)), axis=1)
    rb = np.median(rng.choice(b, (resamples, b.size)), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = rb / ra
    return float(np.median(b) / np.median(a)), float(np.nanquantile(ratios, 0.025)), float(np.nanquantile(ratios, 0.975))


def compare(path_a: str, path_b: str) -> pd.DataFrame:
    a, b = load(path_a), load(path_b)
    keys = [k for k in list((a.config.get("experiment") or {}).get("grid") or {}) if k in b.runs] + ["arm"]
    rows = []
    for key, frame_a in a.runs.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        mask = np.logical_and.reduce([b.runs[k] == v for k, v in zip(keys, key)])
        frame_b = b.runs[mask]
        if frame_b.empty:
            continue
        for metric in METRICS:
            if metric not in frame_a or metric not in frame_b:
                continue
            ratio, lo, hi = ratio_ci(frame_a[metric].to_numpy(float), frame_b[metric].to_numpy(float))
            rows.append({**dict(zip(keys, key)), "metric": metric, "A": float(frame_a[metric].median()),
                         "B": float(frame_b[metric].median()), "B/A": ratio, "ci_low": lo, "ci_high": hi,
                         "beyond_noise": bool(lo > 1 or hi < 1) if not np.isnan(lo) else False})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ablate compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    args = parser.parse_args(argv)
    table = compare(args.run_a, args.run_b)
    if table.empty:
        raise SystemExit("the two runs share no grid point and arm")
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(table.to_string(index=False, float_format=lambda x: f"{x:,.4g}"))
