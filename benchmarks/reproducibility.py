"""Is a speedup reproducible? The same experiment run in fresh processes, one after another.

    .venv/bin/python benchmarks/reproducibility.py [--experiment ch08_kv_cache] [--processes 2] [--work-dir DIR] \\
        [-- OVERRIDES...]
    .venv/bin/python benchmarks/reproducibility.py -- model=tiny 'experiment.grid.output_len=[16,32]'   # quick

`python -m ablate repro +experiment=<experiment> wandb.mode=disabled <overrides>` (ablate/report/repro.py)
with 2 processes by default: each process's speedup with its 95% t-interval on the log ratios of its
rounds (ablate/analysis/stats.py), their geometric mean and max/min, and whether every interval holds
that pooled centre. Beside repro's verdict, this script keeps its own older, pairwise rule and the
noise: per grid point and arm, how many processes' speedups lie inside each other process's interval
(`in others' CI`: k of N(N-1) ordered pairs; reproduced when all, partly when some, not reproduced
when none) and each process's coefficient of variation of run time (on a shared machine a row that
is not reproduced usually shows a high CV beside it). `python -m ablate compare <run 1> <run 2>`
gives every other metric.
"""
from __future__ import annotations

import argparse
import tempfile
from itertools import permutations
from pathlib import Path

import pandas as pd

from ablate.report.repro import closing_line, console_table, new_folder, reproduce


def pairwise(row: pd.Series, num_processes: int) -> tuple[int, int] | None:
    """(ordered pairs (i, j) whose speedup i lies inside interval j, pairs) over the processes; None
    when the arm is not ok in some process (repro's "not comparable")."""
    if any(row[f"status_p{i}"] != "ok" for i in range(1, num_processes + 1)):
        return None
    pairs = list(permutations(range(1, num_processes + 1), 2))
    inside = sum(bool(row[f"ci_low_p{j}"] <= row[f"speedup_p{i}"] <= row[f"ci_high_p{j}"]) for i, j in pairs)
    return inside, len(pairs)


def pairwise_verdict(count: tuple[int, int] | None) -> str:
    if count is None:
        return "not comparable"
    inside, pairs = count
    return "reproduced" if inside == pairs else "partly" if inside else "not reproduced"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="ch08_kv_cache", help="a conf/experiment/*.yaml name")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes, >= 2 (default 2)")
    parser.add_argument("--work-dir", help="where the processes' results go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every process (after --)")
    args = parser.parse_args()
    overrides = [f"+experiment={args.experiment}", "wandb.mode=disabled", *args.overrides]
    folder = new_folder(args.work_dir or tempfile.mkdtemp(prefix="reproducibility-"), overrides)
    try:
        done = reproduce(overrides, args.processes, folder)
    except ValueError as err:       # bad input: one line, as python -m ablate repro says it
        raise SystemExit(f"error: {err}") from None

    table = done.table
    counts = [pairwise(row, args.processes) for _, row in table.iterrows()]
    print("\n" + "\n".join(f"process {i}: {run.path}" for i, run in enumerate(done.runs, 1)) + "\n")
    print(console_table(table, done.point_keys))
    noise = table[[*done.point_keys, "arm"]].assign(**{
        "in others' CI": [f"{c[0]} of {c[1]}" if c else "-" for c in counts],
        "pairwise": [pairwise_verdict(c) for c in counts],
        "CV per process": [" / ".join(f"{row[f'cv_p{i}']:.1%}" for i in range(1, args.processes + 1))
                           for _, row in table.iterrows()]})
    print("\n" + noise.to_string(index=False))
    print(f"\n{closing_line(table, args.processes)}\nVERDICT (pairwise): "
          f"{sum(pairwise_verdict(c) == 'reproduced' for c in counts)} of {len(table)} speedups reproduced (each process's "
          f"speedup inside every other's 95% CI); other metrics: python -m ablate compare {done.runs[0].path} "
          f"{done.runs[1].path}; tables: {Path(folder) / 'repro.csv'}")


if __name__ == "__main__":
    main()
