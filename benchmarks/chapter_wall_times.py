"""Wall time of each chapter experiment at its defaults: what a reader waits for the chapter's table.

    .venv/bin/python benchmarks/chapter_wall_times.py [--only ch10_textbook ch12_flash]
        [--extra 'device=cpu threads=2'] [--results-dir DIR] [--out DIR] [--timeout-s 1800]

Runs every experiment one after the other, each as its own process,

    python -m ablate +experiment=NAME redo=true results_dir=DIR hydra.run.dir=DIR/hydra/NAME [extra ...]

so nothing under results/ or outputs/ is touched (DIR is a temporary folder unless --results-dir
gives one; it is kept, with each run's stdout/stderr in DIR/logs/). Per experiment: the wall time
from process start to exit (Python start-up, imports and the peaks' probe included: what the reader
waits for), the exit status, and the report the run printed. A failed or timed-out experiment is
recorded with its last stderr line and the next one runs. Prints a markdown table; --out DIR also
writes chapter_wall_times.csv and chapter_wall_times.md there. Exits 1 when any experiment failed.

The runs inherit this process's environment. On a machine shared with other busy processes, torch's
OpenMP workers spin while they wait, and each of a decode step's hundreds of small ops then waits
for a descheduled worker (a 576 x 1536 linear at batch 3 measured 20 ms instead of 0.7 ms with 2
threads and four other busy processes on 2 cores); `OMP_WAIT_POLICY=PASSIVE` before the command
measures with sleeping workers instead.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "conf" / "experiment"
CHAPTERS = ("ch07_costs", "ch08_kv_cache", "ch09_paged", "ch10_batching", "ch10_textbook", "ch11_speculative",
            "ch12_flash", "ch13_gqa_mla")
REPORT_PREFIX = "report: "     # the line ablate's job prints last (ablate/experiment/job.py)


@dataclass
class Timing:
    """One experiment's run: how long, how it ended, where its report is (or why it failed)."""
    experiment: str
    command: str
    seconds: float
    status: str        # ok | failed (exit N) | timed out
    report: str        # the report's path, or "" when none was written
    error: str         # the last stderr line of a failed run, else ""


def experiment_names(only: list[str] | None) -> list[str]:
    """The experiments to time, each checked to exist in conf/experiment/."""
    names = only or list(CHAPTERS)
    known = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only: no experiment named {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def command_for(name: str, results_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "ablate", f"+experiment={name}", "redo=true", f"results_dir={results_dir}",
            f"hydra.run.dir={results_dir / 'hydra' / name}", *extra]


def shown(command: list[str]) -> str:
    """The command as a reader would type it: `python -m ablate ...`, without the timing harness's
    own folders (results_dir, hydra.run.dir)."""
    kept = [a for a in command[1:] if not a.startswith(("results_dir=", "hydra.run.dir="))]
    return shlex.join(["python", *kept])


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def report_path(stdout: str) -> str:
    """The path after the last `report: ` line ("" when the run wrote none: `report: None`)."""
    found = [line.split(REPORT_PREFIX, 1)[1].strip() for line in stdout.splitlines() if REPORT_PREFIX in line]
    return found[-1] if found and found[-1] != "None" else ""


def time_one(name: str, results_dir: Path, extra: list[str], timeout_s: float) -> Timing:
    """Run one experiment to its end (or the timeout); its output goes to results_dir/logs/ as it
    comes (`tail -f` shows a long run's progress)."""
    command = command_for(name, results_dir, extra)
    logs = results_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{name}.stdout", logs / f"{name}.stderr"
    with out_path.open("w") as out, err_path.open("w") as err:
        start = time.perf_counter()
        try:
            code: int | None = subprocess.run(command, cwd=REPO, stdout=out, stderr=err,
                                              timeout=timeout_s or None).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:      # subprocess.run has killed it
            code, status = None, "timed out"
        seconds = time.perf_counter() - start
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    error = "" if code == 0 else (last_line(stderr) or f"no output on stderr; see {out_path}")
    if status == "timed out":
        error = f"killed after {timeout_s:g} s" + (f"; last stderr line: {error}" if last_line(stderr) else "")
    return Timing(name, shown(command), round(seconds, 1), status, report_path(stdout), error)


def machine() -> str:
    """One line saying where the times were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    load = ", load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} logical CPUs{load}, Python {platform.python_version()}"


def markdown(timings: list[Timing], extra: list[str]) -> str:
    rows = ["| experiment | command | wall s | status | report / error |", "| --- | --- | ---: | --- | --- |"]
    for t in timings:
        detail = t.report if t.status == "ok" else t.error
        rows.append(f"| {t.experiment} | `{t.command}` | {t.seconds:.1f} | {t.status} | {detail.replace('|', '/')} |")
    head = [f"Measured on {machine()}" + (f"; extra overrides: `{shlex.join(extra)}`" if extra else "") + ".", ""]
    return "\n".join(head + rows)


def write_tables(out: Path, timings: list[Timing], extra: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "chapter_wall_times.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(timings[0])))
        writer.writeheader()
        writer.writerows(asdict(t) for t in timings)
    (out / "chapter_wall_times.md").write_text(markdown(timings, extra) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help=f"experiments to time (default: {' '.join(CHAPTERS)})")
    parser.add_argument("--extra", default="", help="overrides added to every run, e.g. 'device=cpu threads=2'")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where the runs' folders and logs go (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as CSV and markdown here")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="seconds before an experiment is killed and recorded as timed out (0: never)")
    args = parser.parse_args(argv)
    if args.timeout_s < 0:
        parser.error(f"--timeout-s must be >= 0 seconds (0: no limit), got {args.timeout_s:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        names = experiment_names(args.only)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    extra = shlex.split(args.extra)
    results_dir = (args.results_dir or Path(tempfile.mkdtemp(prefix="chapter_wall_times_"))).resolve()
    print(f"runs and logs: {results_dir}", flush=True)
    timings = []
    for name in names:
        print(f"{name} ...", end=" ", flush=True)
        timing = time_one(name, results_dir, extra, args.timeout_s)
        print(f"{timing.seconds:.1f} s, {timing.status}" + (f": {timing.error}" if timing.error else ""), flush=True)
        timings.append(timing)
    print()
    print(markdown(timings, extra))
    if args.out:
        write_tables(args.out, timings, extra)
        print(f"\nwritten: {args.out / 'chapter_wall_times.csv'}, {args.out / 'chapter_wall_times.md'}")
    return 0 if all(t.status == "ok" for t in timings) else 1


if __name__ == "__main__":
    sys.exit(main())
