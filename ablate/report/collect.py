"""`python -m ablate collect <results/<experiment>>`: every job of a sweep joined into tidy tables.

A sweep (`python -m ablate -m +experiment=X workload.num_requests=4,8`) writes one run folder per
job, results/<experiment>/<run-id>/. `collect` reads them all (below results/<experiment>, or below
results/ for every experiment) into two tables:

- runs: one row per job x grid point x arm x round (the jobs' runs.csv);
- summary: one row per job x grid point x arm (their summary.csv: medians, speedup and its CI).

Each row carries its job (the run id), experiment, the job's status (done / failed / running) and
error, its config flattened into `config.<dotted.key>` columns, then arm, label, repeat, grid keys,
and every metric with its unit in its name (UNITS gives one to those that lack it; a plugin's
columns keep their names); an arm's own status is `arm_status`. Swept: the config keys whose values
differ between jobs, and the grid keys. A failed job is one row with its error; a folder that is not
a run, or a file that cannot be read, is left out with a warning naming it. Written (into the folder
collected, or --out): sweep_{runs,summary}.{csv,parquet} and sweep_report.md (sweep_plots.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ablate.report.compare import NOT_COMPARED, flatten
from ablate.report.sweep_plots import write_sweep_report
from ablate.results import DONE, write_atomic, write_file_atomic

FAILED = "failed.json"
# core metrics whose names do not end in their unit (_s, _ms, _bytes, _tok_s, _req_s): the name with one
UNITS = {
    "speedup": "speedup_x", "speedup_ci_low": "speedup_ci_low_x", "speedup_ci_high": "speedup_ci_high_x",
    "predicted_speedup": "predicted_speedup_x", "memory_ratio": "memory_ratio_x", "ppl_ratio": "ppl_ratio_x",
    "speedup_rounds": "speedup_rounds_count", "duration_cv": "duration_cv_frac", "mfu": "mfu_frac",
    "kv_util_mean": "kv_util_mean_frac", "kv_util_at_peak": "kv_util_at_peak_frac", "mbu_decode": "mbu_decode_frac",
    "baseline_agreement": "baseline_agreement_frac", "token_agreement": "token_agreement_frac",
    "tokens_per_emission": "tokens_per_emission_tok", "output_tokens": "output_tokens_tok",
    "prompt_tokens": "prompt_tokens_tok", "kv_bytes_per_token": "kv_per_token_bytes", "requests": "requests_count",
    "steps": "steps_count", "preemptions": "preemptions_count", "batch_size_mean": "batch_size_mean_seqs",
    "batch_size_max": "batch_size_max_seqs", "seqs_admitted_max": "seqs_admitted_max_seqs",
    "seqs_admitted_mean": "seqs_admitted_mean_seqs", "seqs_admitted_while_queued": "seqs_admitted_while_queued_seqs",
    "predicted_step_time_s_total": "predicted_step_time_total_s",
    "measured_step_time_s_total": "measured_step_time_total_s",
    "perplexity": "perplexity_ppl",     # exp(mean nats per token): its own unit
    "kernel_compiles": "kernel_compiles_count", "path_timings": "path_timings_count",
    # what the CPU did during a run (ablate.measure.cpu_load)
    "cpu_time_share": "cpu_time_share_frac", "cpu_others_cores": "cpu_others_cpus", "cpu_steal_share":
    "cpu_steal_share_frac", "cpu_wait_share": "cpu_wait_share_frac", "cpu_left_share": "cpu_left_share_frac",
    "involuntary_switches": "involuntary_switches_count", "load_1m": "load_1m_procs",
    "contended_rounds": "contended_rounds_count",
}
# a table's own columns that would clash with the job's
CLASHES = {"status": "arm_status", "status_detail": "arm_status_detail"}
JOB_COLUMNS = ("job", "experiment", "status", "error")
ID_COLUMNS = ("arm", "label", "repeat")


class NotASweep(ValueError):
    """The path given holds no run folders (the message says what would)."""


@dataclass
class Job:
    path: Path
    status: str                 # done | failed | running
    error: str | None
    raw: dict[str, Any]         # config.json as written
    config: dict[str, Any]      # flattened, lists and dicts as JSON text
    tables: dict[str, pd.DataFrame]

    @property
    def experiment(self) -> str:
        return (self.raw.get("experiment") or {}).get("name") or self.path.parent.name

    @property
    def grid(self) -> list[str]:
        return list((self.raw.get("experiment") or {}).get("grid") or {})


@dataclass
class Sweep:
    root: Path
    runs: pd.DataFrame          # job x grid point x arm x round
    summary: pd.DataFrame       # job x grid point x arm
    swept: list[str]            # columns of runs and summary whose values the sweep varied
    grid_keys: list[str]
    jobs: pd.DataFrame          # one row per job: job, experiment, status, error, path
    problems: list[str] = field(default_factory=list)    # folders and files left out, and why
    files: dict[str, Path] = field(default_factory=dict)  # what write_sweep wrote

    def counts(self) -> dict[str, int]:
        return {s: int((self.jobs["status"] == s).sum()) for s in ("done", "failed", "running")}


def _is_run(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def job_folders(root: Path, problems: list[str], depth: int = 2) -> list[Path]:
    """Run folders at `root` or below: results/<experiment>/<id> (depth 1) or results/ (depth 2)."""
    if _is_run(root):
        return [root]
    found = []
    for child in _subfolders(root):
        if ".old-" in child.name:
            problems.append(f"{child}: moved aside by a redo (superseded), left out")
        elif _is_run(child):
            found.append(child)
        elif depth > 1 and any(_is_run(p) for p in _subfolders(child)):
            found += job_folders(child, problems, depth - 1)
        else:
            problems.append(f"{child}: not a run folder (no config.json), left out")
    return found


def _read_json(file: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        problems.append(f"{file}: unreadable ({type(err).__name__}: {err})")
        return None


def _read_csv(file: Path, problems: list[str]) -> pd.DataFrame:
    if not file.exists() or file.stat().st_size <= 1:
        return pd.DataFrame()
    try:
        return pd.read_csv(file)
    except (ValueError, UnicodeDecodeError) as err:     # pandas' ParserError and EmptyDataError are ValueErrors
        problems.append(f"{file}: corrupt CSV ({type(err).__name__}: {str(err).strip()}), its rows are left out")
        return pd.DataFrame()


def _cell(value: Any) -> Any:
    """A config value as a table cell: lists and dicts as JSON text, scalars as they are."""
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (list, dict, tuple)) else value


def read_job(path: Path, problems: list[str]) -> Job | None:
    raw = _read_json(path / "config.json", problems)
    if not isinstance(raw, dict):       # None: unreadable, said by _read_json
        if raw is not None:
            problems.append(f"{path}: its config.json is not a JSON object (it holds a {type(raw).__name__}), "
                            "the job is left out")
        return None
    status, error = "running", None
    if (path / DONE).exists():
        status = "done"
    elif (path / FAILED).exists():
        status = "failed"
        error = (_read_json(path / FAILED, problems) or {}).get("error") or f"{FAILED} names no error"
    tables = {name: _read_csv(path / f"{name}.csv", problems) for name in ("runs", "summary")}
    return Job(path, status, error, raw, {k: _cell(v) for k, v in flatten(raw).items()}, tables)


def _job_frame(job: Job, table: str, grid_keys: list[str]) -> pd.DataFrame:
    """One job's rows of `table` (at least one: a job without rows is still a job), head columns first."""
    head = {"job": job.path.name, "experiment": job.experiment, "status": job.status, "error": job.error,
            **{f"config.{k}": v for k, v in job.config.items()}}
    workload = job.raw.get("workload") or {}
    # a grid key this job did not sweep was held at its workload value
    point = {k: _cell(workload.get(k)) for k in grid_keys if k not in job.grid}
    frame = job.tables[table].rename(columns={**CLASHES, **UNITS})
    if frame.empty:
        return pd.DataFrame([head | point])
    frame = frame.assign(**{k: v for k, v in point.items() if k not in frame})
    heads = pd.DataFrame([head] * len(frame), index=frame.index)
    return pd.concat([heads, frame], axis=1)


def _ordered(frame: pd.DataFrame, table: str, grid_keys: list[str]) -> pd.DataFrame:
    """Job columns, config, arm, label (and repeat in runs), grid keys, then the table's own columns."""
    ids = [c for c in ID_COLUMNS if table == "runs" or c != "repeat"]
    frame = frame.assign(**{c: None for c in ids if c not in frame})     # no job had a readable row
    config = sorted(c for c in frame if c.startswith("config."))
    first = [c for c in [*JOB_COLUMNS, *config, *ids, *grid_keys] if c in frame]
    return frame[first + [c for c in frame if c not in first]]


def swept_keys(jobs: list[Job], grid_keys: list[str]) -> list[str]:
    """`config.<key>` for every config key whose value differs between jobs (where results went, and
    the grid's lists, which the grid keys stand for, aside), then the grid keys."""
    keys = sorted(set().union(*(job.config for job in jobs)))
    varied = [k for k in keys if k.split(".")[0] not in NOT_COMPARED and not k.startswith("experiment.grid.")
              and len({json.dumps(job.config.get(k), default=str) for job in jobs}) > 1]
    return [f"config.{k}" for k in varied] + grid_keys


def collect(root: str | os.PathLike, out: str | os.PathLike | None = None, *, write: bool = True) -> Sweep:
    """Every job below `root` joined into a Sweep; with `write`, its tables and report are written
    into `out` (default: `root`). Raises NotASweep when `root` holds no run folder."""
    root = Path(root)
    if not root.is_dir():
        raise NotASweep(f"{root} {'is a file' if root.exists() else 'does not exist'}: give the folder of a "
                        "sweep's run folders, results/<experiment> (or results/ for every experiment)")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise NotASweep(f"--out {out} is a file: give a folder for the tables and the report")
    problems: list[str] = []
    jobs = [job for path in job_folders(root, problems) if (job := read_job(path, problems))]
    for problem in problems:
        warnings.warn(problem, stacklevel=2)
    unreadable = [p for p in problems if "its config.json" in p or "config.json: unreadable" in p]
    if not jobs and unreadable:         # run folders there, none readable: say why, not that there are none
        raise NotASweep(f"{root} holds no readable run: {'; '.join(unreadable)}")
    if not jobs:
        raise NotASweep(f"{root} holds no run folder (a folder with config.json, written by python -m ablate): "
                        "give results/<experiment> (or results/)")
    grid_keys = list(dict.fromkeys(k for job in jobs for k in job.grid))
    tables = {name: _ordered(pd.concat([_job_frame(job, name, grid_keys) for job in jobs], ignore_index=True,
                                       sort=False), name, grid_keys) for name in ("runs", "summary")}
    listing = pd.DataFrame([{"job": job.path.name, "experiment": job.experiment, "status": job.status,
                             "error": job.error, "path": str(job.path)} for job in jobs])
    sweep = Sweep(root, tables["runs"], tables["summary"], swept_keys(jobs, grid_keys), grid_keys, listing, problems)
    if write:
        write_sweep(sweep, out)
    return sweep


def storable(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame as CSV and Parquet both hold it: "" is missing (a CSV cannot tell them apart), a column
    of no values is float NaN, a column mixing kinds of values (numbers and text) is text."""
    frame = frame.copy()
    for column in frame.columns:
        if pd.api.types.is_numeric_dtype(frame[column]) or pd.api.types.is_bool_dtype(frame[column]):
            continue
        frame[column] = frame[column].astype(object).where(frame[column].ne("") & frame[column].notna(), None)
        values = frame[column].dropna()
        if values.empty:
            frame[column] = frame[column].astype(float)
            continue
        kinds = {"bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else
                 "str" if isinstance(v, str) else "other" for v in values}
        if len(kinds) > 1 or "other" in kinds:
            frame[column] = frame[column].map(lambda v: v if v is None or v != v else str(v))
    return frame


def write_sweep(sweep: Sweep, out: str | os.PathLike | None = None) -> dict[str, Path]:
    """sweep_{runs,summary}.{csv,parquet} and sweep_report.md (with its PNGs) into `out` (default: the
    root), each written atomically; returns name -> path, also kept in sweep.files."""
    out = Path(out) if out is not None else sweep.root
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, frame in (("runs", sweep.runs), ("summary", sweep.summary)):
        frame, csv, parquet = storable(frame), out / f"sweep_{name}.csv", out / f"sweep_{name}.parquet"
        write_atomic(csv, frame.to_csv(index=False))
        write_file_atomic(parquet, lambda tmp, frame=frame: frame.to_parquet(tmp, index=False))
        files |= {csv.name: csv, parquet.name: parquet}
    report, figures = write_sweep_report(sweep, out)
    files["sweep_report.md"] = report
    files |= {path.name: path for path in figures.values()}
    sweep.files = files
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ablate collect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="results/<experiment> (one sweep's run folders) or results/ (every experiment)")
    parser.add_argument("--out", help="folder for the tables and the report (default: PATH itself)")
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # the problems are printed below, once each
            sweep = collect(args.path, args.out)
    except NotASweep as err:
        print(f"python -m ablate collect: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    for problem in sweep.problems:
        print(f"warning: {problem}", file=sys.stderr)
    counts = sweep.counts()
    print(f"{len(sweep.jobs)} jobs: {counts['done']} done, {counts['failed']} failed"
          + (f", {counts['running']} running (no done.json yet)" if counts["running"] else ""))
    print(f"swept: {', '.join(sweep.swept) or 'nothing (the jobs share one config)'}")
    print(f"tables: {sweep.files['sweep_runs.csv']} ({len(sweep.runs)} rows), {sweep.files['sweep_summary.csv']} "
          f"({len(sweep.summary)} rows), and .parquet beside each")
    figures = [name for name in sweep.files if name.endswith(".png")]
    print(f"report: {sweep.files['sweep_report.md']}" + (f" (figures: {', '.join(figures)})" if figures else ""))


if __name__ == "__main__":
    main()
