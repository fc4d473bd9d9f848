"""Coverage of the speedup interval at the rounds a benchmark runs: the t-interval on log ratios
that ablate reports (ablate.analysis.stats.log_interval) against the percentile bootstrap of the
median it replaced, on simulated per-round ratios of known distribution (ablate.analysis.coverage).

    python benchmarks/interval_coverage.py                  # 4000 trials per cell, ~1 min on 2 cores
    python benchmarks/interval_coverage.py --trials 1000 --out coverage.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from ablate.analysis.coverage import MODELS, coverage, percentile_bootstrap
from ablate.analysis.stats import CONFIDENCE, log_interval


def t_on_logs(ratios: np.ndarray) -> tuple[float, float]:
    interval = log_interval(ratios)
    return interval.low, interval.high


METHODS = {"t on log ratios (ablate)": t_on_logs, "percentile bootstrap of the median (before)": percentile_bootstrap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4000, help="simulated experiments per cell")
    parser.add_argument("--rounds", type=int, nargs="+", default=[3, 5, 10])
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    stderr = np.sqrt(CONFIDENCE * (1 - CONFIDENCE) / args.trials)
    print(f"nominal {CONFIDENCE:.0%}; {args.trials} trials per cell (binomial standard error {stderr:.1%})\n")
    rows = []
    header = f"{'method':45s} {'model':13s} " + " ".join(f"{f'n={n}':>7s}" for n in args.rounds)
    print(header)
    for method_name, method in METHODS.items():
        for model in MODELS:
            achieved = [coverage(method, model, n, args.trials, seed=n) for n in args.rounds]
            rows.append({"method": method_name, "model": model, **{f"n={n}": a for n, a in zip(args.rounds, achieved)}})
            print(f"{method_name:45s} {model:13s} " + " ".join(f"{a:7.1%}" for a in achieved))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"nominal": CONFIDENCE, "trials": args.trials, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
