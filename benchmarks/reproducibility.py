"""Is a speedup reproducible? The same experiment run twice, each in a fresh process.

    .venv/bin/python benchmarks/reproducibility.py [--experiment ch08_kv_cache] [--work-dir DIR] [-- OVERRIDES...]
    .venv/bin/python benchmarks/reproducibility.py -- model=tiny 'experiment.grid.output_len=[16,32]'   # quick

Runs `python -m ablate +experiment=<experiment> <overrides>` twice, one after the other, each with
its own results folder (the config, hence the run id, is the same). Then, per grid point and arm:
both speedup medians with their bootstrap 95% CIs, whether each median lies inside the other run's
CI, and both runs' coefficients of variation. Verdict per row: reproduced (each median inside the
other's CI), partly (one of the two), not reproduced (neither). On a shared machine a row that is
not reproduced usually shows a high CV beside it. `python -m ablate compare <run 1> <run 2>` gives
every other metric.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from ablate.results import load, runs_under

REPO = Path(__file__).resolve().parent.parent


def run_experiment(experiment: str, overrides: list[str], results_dir: Path, log: Path) -> Path:
    """One fresh `python -m ablate` process; returns its run folder."""
    command = [sys.executable, "-m", "ablate", f"+experiment={experiment}", *overrides,
               f"results_dir={results_dir}", "wandb.mode=disabled", f"hydra.run.dir={results_dir / 'hydra'}"]
    print("running:", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the run failed (exit {done.returncode}); its output is in {log}:\n{done.stderr[-2000:]}")
    (run,) = runs_under(results_dir)
    return run


def inside(x: float, low: float, high: float) -> bool:
    return bool(low <= x <= high)


def verdicts(first: pd.DataFrame, second: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame:
    """Per grid point and non-baseline arm: both speedups with CIs and whether each lies in the other's CI."""
    keys = [*point_keys, "arm"]
    both = first.merge(second, on=keys, suffixes=("_1", "_2"))
    both = both[~((both["speedup_1"] == 1) & (both["speedup_ci_low_1"] == 1) & (both["speedup_ci_high_1"] == 1))]
    rows = []
    for _, r in both.iterrows():
        one_in_two = inside(r["speedup_1"], r["speedup_ci_low_2"], r["speedup_ci_high_2"])
        two_in_one = inside(r["speedup_2"], r["speedup_ci_low_1"], r["speedup_ci_high_1"])
        verdict = {2: "reproduced", 1: "partly"}.get(one_in_two + two_in_one, "not reproduced")
        rows.append({**{k: r[k] for k in keys},
                     "run 1 speedup [95% CI]": f"{r['speedup_1']:.2f}x [{r['speedup_ci_low_1']:.2f}, "
                                               f"{r['speedup_ci_high_1']:.2f}]",
                     "run 2 speedup [95% CI]": f"{r['speedup_2']:.2f}x [{r['speedup_ci_low_2']:.2f}, "
                                               f"{r['speedup_ci_high_2']:.2f}]",
                     "1 in CI 2": "yes" if one_in_two else "no", "2 in CI 1": "yes" if two_in_one else "no",
                     "CV 1 / 2": f"{r['duration_cv_1']:.1%} / {r['duration_cv_2']:.1%}", "verdict": verdict})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="ch08_kv_cache", help="a conf/experiment/*.yaml name")
    parser.add_argument("--work-dir", help="where both runs' results go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (after --)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="reproducibility-")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    runs = [run_experiment(args.experiment, args.overrides, work / f"run{i}", work / f"run{i}.log") for i in (1, 2)]
    first, second = (load(r) for r in runs)
    point_keys = list((first.config.get("experiment") or {}).get("grid") or {})
    table = verdicts(first.summary, second.summary, point_keys)
    if table.empty:
        raise SystemExit("no arm besides the baseline: nothing to compare")

    print(f"\nrun 1: {runs[0]}\nrun 2: {runs[1]}\n")
    with pd.option_context("display.width", 250, "display.max_colwidth", 40):
        print(table.to_string(index=False))
    counts = table["verdict"].value_counts()
    print(f"\nVERDICT: {counts.get('reproduced', 0)} of {len(table)} speedups reproduced (each median inside the "
          f"other run's 95% CI), {counts.get('partly', 0)} partly, {counts.get('not reproduced', 0)} not; "
          f"other metrics: python -m ablate compare {runs[0]} {runs[1]}")


if __name__ == "__main__":
    main()
