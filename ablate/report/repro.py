"""`python -m ablate repro [--processes N] [--out DIR] <overrides...>`: does a speedup reproduce from
one fresh process to the next, as closely as its within-run interval claims?

The experiment the overrides compose runs N times (3 by default), one process after another (never
together: they would share the CPU), each `python -m ablate <overrides> redo=true` with its own
results_dir, <out>/process<i>/, so each is measured afresh. Per grid point and arm but the baseline,
from each process's summary (speedup s_i with its 95% interval [low_i, high_i], a t-interval on the
log ratios of its rounds: ablate.analysis.stats):

    centre c         = exp(mean_i log s_i)                  the geometric mean over processes
    over processes   = exp(mean_i log s_i -/+ t_{0.975, N-1} sd_i(log s_i) / sqrt(N))   (log_interval)
    max/min          = max_i s_i / min_i s_i
    within-run +-    = mean_i (sqrt(high_i / low_i) - 1)    the intervals' mean relative half-width
    widening         = max_i |log s_i - log c| / h_i, h_i = log(high_i / s_i) if c > s_i else log(s_i / low_i)

Verdict: "agree" when every process's interval contains the pooled centre (widening <= 1), else
"disagree: the within-run intervals understate the run-to-run spread by <widening>x" (how many times
wider, on the log scale, they would have to be to contain it). Why this rule: the centre averages the
processes' own noise away; an interval that excludes it claims a precision that the other processes'
measurements contradict, and with honest 95% intervals all of 3 contain it nearly always. An arm that
is not `ok` in some process (failed, diverged, degraded, noisy, missing, or without an interval) is
"not comparable", never an agreeing speedup. The table is written to <out>/repro.{csv,json} and
printed; exit 0 when every arm agrees, 1 otherwise, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ablate.analysis.stats import MIN_ROUNDS, Interval, log_interval
from ablate.report.compare import baseline_arm, load_runs
from ablate.results import Results, runs_under, write_atomic

PROCESSES = 3
SET_BY_REPRO = ("redo", "hydra.run.dir")      # every process is measured afresh, in its own folder
AGREE = "agree"


def process_command(overrides: list[str], results_dir: Path) -> list[str]:
    """One fresh measurement: its own results folder (and Hydra's), and redo in case it is not empty."""
    return [sys.executable, "-m", "ablate", *overrides, f"results_dir={results_dir}", "redo=true",
            f"hydra.run.dir={results_dir / 'hydra'}"]


def run_process(overrides: list[str], folder: Path, index: int, num_processes: int) -> Path:
    """Run process `index` (1-based) into folder/process<index>/; returns its run folder. Its output
    goes to folder/process<index>.log as it runs (a long run can be followed there)."""
    results_dir = folder / f"process{index}"
    log = folder / f"process{index}.log"
    print(f"process {index} of {num_processes}: python -m ablate {' '.join(overrides)} (output: {log})", flush=True)
    started = time.monotonic()
    with open(log, "w") as output:
        returncode = subprocess.run(process_command(overrides, results_dir), stdout=output,
                                    stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        # python -m ablate ends a failure in one `error: ...` line; Hydra's own errors and signals do not
        said = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
        why = said[-1].removeprefix("error: ") if said else \
            f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
        if returncode == 2:
            raise ValueError(f"process {index} refused the experiment: {why} (its output: {log})")
        print(f"error: process {index} of {num_processes} failed: {why}; its output is in {log}",
              file=sys.stderr, flush=True)
        sys.exit(1)
    runs = runs_under(results_dir)
    if len(runs) != 1:
        raise ValueError(f"process {index} left {len(runs)} finished run folders under {results_dir}, expected 1: "
                         "repro measures one experiment, not a sweep")
    print(f"  done in {time.monotonic() - started:.0f} s: {runs[0]}", flush=True)
    return runs[0]


def _is_true(value: object) -> bool:
    return str(value).strip().lower() in ("true", "1", "1.0")


def _number(row: pd.Series | None, column: str) -> float:
    value = None if row is None else row.get(column)
    return float(value) if value is not None and pd.notna(value) else math.nan


def process_status(row: pd.Series | None) -> tuple[str, Interval]:
    """One arm in one process: "ok" and its speedup interval, or why it has no speedup to compare."""
    note = "" if row is None or pd.isna(row.get("speedup_note", "")) else str(row.get("speedup_note", ""))
    rounds = _number(row, "speedup_rounds")
    interval = Interval(_number(row, "speedup"), _number(row, "speedup_ci_low"), _number(row, "speedup_ci_high"),
                        0 if math.isnan(rounds) else int(rounds), note)
    if row is None:
        return "missing", interval
    status = str(row.get("status", "ok"))
    # noisy: measured on a contended CPU. A status now; a summary flag (then: run-time CV above 10%)
    # before it was one. Either way its interval is not the machine's own spread, so not compared.
    if status == "ok" and _is_true(row.get("noisy", False)):
        status = "noisy"
    if status == "ok" and not interval.is_supported:
        status = f"no interval ({note or 'no speedup'})"
    return status, interval


def needed_widening(intervals: list[Interval], centre: float) -> float:
    """How many times wider (log scale) the intervals must be for every one to contain `centre`
    (<= 1: they all do already)."""
    worst = 0.0
    for interval in intervals:
        distance = abs(math.log(interval.center / centre))
        half = math.log(interval.high / interval.center) if centre > interval.center \
            else math.log(interval.center / interval.low)
        if distance > 0:
            worst = max(worst, distance / half if half > 0 else math.inf)
    return worst


def not_ok(statuses: tuple[str, ...]) -> str:
    """'noisy in process 2', 'failed in processes 1 and 3; missing in process 2'."""
    where: dict[str, list[str]] = {}
    for i, status in enumerate(statuses, 1):
        if status != "ok":
            where.setdefault(status, []).append(str(i))
    return "; ".join(f"{status} in process {i[0]}" if len(i) == 1 else
                     f"{status} in processes {', '.join(i[:-1])} and {i[-1]}" for status, i in where.items())


def arm_agreement(rows: list[pd.Series | None]) -> dict:
    """One grid point x arm over the processes (a summary row each; None where the arm is missing)."""
    out: dict = {"processes": len(rows)}
    statuses, intervals = zip(*(process_status(row) for row in rows))
    for i, (status, interval, row) in enumerate(zip(statuses, intervals, rows), 1):
        out |= {f"speedup_p{i}": interval.center, f"ci_low_p{i}": interval.low, f"ci_high_p{i}": interval.high,
                f"status_p{i}": status, f"cv_p{i}": _number(row, "duration_cv")}
    if any(status != "ok" for status in statuses):
        return out | {"verdict": f"not comparable: {not_ok(statuses)}"}
    between = log_interval([interval.center for interval in intervals])
    speedups = [interval.center for interval in intervals]
    widening = needed_widening(list(intervals), between.center)
    out |= {"geomean": between.center, "geomean_ci_low": between.low, "geomean_ci_high": between.high,
            "max_over_min": max(speedups) / min(speedups),
            "within_half_width": float(np.mean([interval.relative_half_width for interval in intervals])),
            "between_half_width": between.relative_half_width if between.is_supported else math.nan,
            "widening": widening}
    verdict = AGREE if widening <= 1 else \
        f"disagree: the within-run intervals understate the run-to-run spread by {widening:.1f}x"
    return out | {"verdict": verdict}


def agreement(summaries: list[pd.DataFrame], point_keys: list[str], baseline: str) -> pd.DataFrame:
    """One row per grid point x arm but the baseline, in the order the processes' summaries list them."""
    keys = [*point_keys, "arm"]
    indexed = [{tuple(row[k] for k in keys): row for _, row in summary.iterrows()} for summary in summaries]
    every = list(dict.fromkeys(key for rows in indexed for key in rows))
    return pd.DataFrame([dict(zip(keys, key)) | arm_agreement([rows.get(key) for rows in indexed])
                         for key in every if key[-1] != baseline])


def console_table(table: pd.DataFrame, point_keys: list[str]) -> str:
    """Each process's speedup [95% CI], the spread over processes, the within-run half-width, the verdict."""
    def cell(row: pd.Series, i: int) -> str:
        status = row[f"status_p{i}"]
        if status.startswith("no interval"):
            return f"{row[f'speedup_p{i}']:.2f}x [no interval]"
        interval = Interval(row[f"speedup_p{i}"], row[f"ci_low_p{i}"], row[f"ci_high_p{i}"], 0)
        return interval.text() if status == "ok" else status.upper()

    def spread(row: pd.Series) -> str:
        n = int(row["processes"])
        return Interval(row["geomean"], row["geomean_ci_low"], row["geomean_ci_high"], n,
                        f"{n} processes, an interval needs {MIN_ROUNDS}").text()

    shown = table[[*point_keys, "arm"]].copy()
    for i in range(1, int(table["processes"].iloc[0]) + 1):
        shown[f"process {i}"] = [cell(row, i) for _, row in table.iterrows()]
    compared = table.get("geomean", pd.Series(np.nan, index=table.index)).notna()
    shown["over processes"] = [spread(r) if ok else "-" for ok, (_, r) in zip(compared, table.iterrows())]
    shown["max/min"] = [f"{r['max_over_min']:.2f}" if ok else "-" for ok, (_, r) in zip(compared, table.iterrows())]
    shown["within-run ±"] = [f"±{r['within_half_width']:.1%}" if ok else "-"
                             for ok, (_, r) in zip(compared, table.iterrows())]
    shown["verdict"] = table["verdict"]
    with pd.option_context("display.width", 300, "display.max_rows", 1000, "display.max_colwidth", 100):
        return shown.to_string(index=False)


def closing_line(table: pd.DataFrame, num_processes: int) -> str:
    agreeing = int((table["verdict"] == AGREE).sum())
    if agreeing == len(table):
        return (f"all {len(table)} speedups agree across {num_processes} processes (every process's 95% interval "
                "contains their geometric mean)")
    disagreeing = int(table["verdict"].str.startswith("disagree").sum())
    return (f"{len(table) - agreeing} of {len(table)} speedups do not agree across {num_processes} processes: "
            f"{disagreeing} disagree, {len(table) - agreeing - disagreeing} not comparable (not ok in some process)")


def new_folder(out: str | None, overrides: list[str]) -> Path:
    """--out (new or empty), else <results_dir>/repro/<time>: a folder that holds nothing yet, so that
    every run folder under it is this command's."""
    if out is None:
        results = next((o.split("=", 1)[1] for o in overrides if o.startswith("results_dir=")), "results")
        folder = Path(results) / "repro" / time.strftime("%Y-%m-%d_%H-%M-%S")
        while folder.exists():
            folder = folder.with_name(folder.name + "+")
    else:
        folder = Path(out)
        if folder.exists() and any(folder.iterdir()):
            raise ValueError(f"--out {folder} already holds files: give a new or empty folder (each repro measures "
                             "afresh into it)")
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


@dataclass
class Reproduction:
    folder: Path                # <out>: process<i>/, process<i>.log, repro.csv, repro.json
    runs: list[Results]         # each process's run, in order
    point_keys: list[str]       # the experiment's grid keys
    baseline: str
    table: pd.DataFrame         # agreement(): one row per grid point x arm but the baseline


def check_overrides(overrides: list[str], num_processes: int) -> None:
    """Bad input, refused before anything runs."""
    if num_processes < 2:
        raise ValueError(f"--processes {num_processes}: at least 2 are needed to see a run-to-run spread")
    if set_here := [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in SET_BY_REPRO]:
        raise ValueError(f"{' '.join(set_here)}: repro sets {' and '.join(SET_BY_REPRO)} itself (a fresh measurement "
                         "per process, each in its own folder): drop it")


def reproduce(overrides: list[str], num_processes: int, folder: Path) -> Reproduction:
    """Run the experiment in `num_processes` fresh processes into `folder` (new_folder), one after
    another, and write the agreement of their speedups there (repro.csv, repro.json)."""
    check_overrides(overrides, num_processes)
    overrides = [o for o in overrides if not o.startswith("results_dir=")]     # each process gets its own
    runs = [load_runs(run_process(overrides, folder, 1, num_processes))]
    point_keys = list((runs[0].config.get("experiment") or {}).get("grid") or {})
    baseline = baseline_arm(runs[0])
    if agreement([runs[0].summary], point_keys, baseline).empty:     # before spending the other processes
        raise ValueError(f"the experiment has no arm besides its baseline {baseline!r}: no speedup to reproduce "
                         "(name the arms in experiment.arms)")
    runs += [load_runs(run_process(overrides, folder, i, num_processes)) for i in range(2, num_processes + 1)]
    table = agreement([r.summary for r in runs], point_keys, baseline)
    write_atomic(folder / "repro.csv", table.to_csv(index=False))
    write_atomic(folder / "repro.json", json.dumps(json.loads(table.to_json(orient="records")), indent=2))
    return Reproduction(folder, runs, point_keys, baseline, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ablate repro", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=PROCESSES, help=f"fresh processes, >= 2 (default {PROCESSES})")
    parser.add_argument("--out", help="the repro folder, new or empty (default: <results_dir>/repro/<time>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment, e.g. +experiment=quickstart")
    args = parser.parse_intermixed_args(argv)
    check_overrides(args.overrides, args.processes)
    done = reproduce(args.overrides, args.processes, new_folder(args.out, args.overrides))
    print(f"\nspeedup over {done.baseline} in {args.processes} fresh processes (95% intervals; "
          f"{done.folder / 'repro.csv'}):\n")
    print(console_table(done.table, done.point_keys))
    print("\n" + closing_line(done.table, args.processes))
    sys.exit(0 if (done.table["verdict"] == AGREE).all() else 1)
