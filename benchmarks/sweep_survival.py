"""A sweep survives being killed: no finished job is lost, none is re-run, the interrupted one completes.

    .venv/bin/python benchmarks/sweep_survival.py [--jobs 4] [--output-len 64] [--work-dir DIR]

1. Starts a Hydra multirun sweep (`python -m ablate -m ...`) of `--jobs` quick tiny-model jobs
   (one per workload seed) in its own process group.
2. As soon as one job has finished (done.json) while the next has started (config.json without
   done.json), kills the whole sweep with SIGKILL: no handler runs, as after a crash or an OOM kill.
3. Re-runs the very same command and checks, per job: a job finished before the kill kept its
   done.json and runs.csv byte for byte and untouched (same mtime: not re-run) and was reported as
   skipped; the interrupted job finished this time; every job is done, none failed, none moved aside.
Prints a table of the jobs and a verdict; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK = ["model=tiny", "kv_cache=contiguous", "experiment.repeats=2", "experiment.warmup=0",
         "workload.num_requests=2", "workload.prompt_len=16", "device=cpu", "threads=1", "peak_bandwidth=1e10",
         "peak_flops=1e11"]


@dataclass
class Job:
    """What one run folder looked like at a moment: its files' bytes and modification times."""
    path: Path
    done: bytes | None
    done_mtime: int | None
    runs_mtime: int | None

    @classmethod
    def read(cls, path: Path) -> Job:
        done, runs = path / "done.json", path / "runs.csv"
        return cls(path, done.read_bytes() if done.exists() else None,
                   done.stat().st_mtime_ns if done.exists() else None,
                   runs.stat().st_mtime_ns if runs.exists() else None)

    @property
    def finished(self) -> bool:
        return self.done is not None


def jobs_under(results: Path) -> dict[str, Job]:
    """run id -> Job, for every run folder started (a config.json written) under results/."""
    return {p.parent.name: Job.read(p.parent) for p in results.glob("*/*/config.json")}


def sweep_command(args: argparse.Namespace, work: Path) -> list[str]:
    seeds = ",".join(str(s) for s in range(args.jobs))
    return [sys.executable, "-m", "ablate", "-m", *QUICK, f"workload.output_len={args.output_len}",
            f"workload.seed={seeds}", f"wandb.mode={args.wandb}", f"results_dir={work / 'results'}",
            f"hydra.sweep.dir={work / 'multirun'}"]


def run_and_kill(command: list[str], results: Path, log: Path, timeout_s: float) -> dict[str, Job] | None:
    """Start the sweep; SIGKILL its process group once a job is done and the next one has started.
    Returns the jobs as they were at the kill, or None if the sweep ended before that moment came."""
    with log.open("w") as out:
        sweep = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while sweep.poll() is None and time.monotonic() < deadline:
            jobs = jobs_under(results)
            if any(j.finished for j in jobs.values()) and any(not j.finished for j in jobs.values()):
                os.killpg(sweep.pid, signal.SIGKILL)     # the sweep and any child, with no chance to clean up
                sweep.wait()
                return jobs_under(results)               # read after the kill: nothing changes any more
            time.sleep(0.05)
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4, help="jobs in the sweep (one per workload seed)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request: how long a job takes")
    parser.add_argument("--wandb", default="disabled", choices=["disabled", "offline"])
    parser.add_argument("--work-dir", help="where results and logs go (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each sweep may take")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="sweep-survival-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results"
    command = sweep_command(args, work)
    print("sweep:", " ".join(command[1:]))
    print(f"work folder: {work}\n")

    at_kill = run_and_kill(command, results, work / "first.log", args.timeout)
    if at_kill is None:
        print(f"VERDICT: not tested: the sweep ended before it could be killed between jobs "
              f"(see {work / 'first.log'}); raise --output-len so that each job takes longer")
        sys.exit(1)
    finished = {k for k, j in at_kill.items() if j.finished}
    interrupted = {k for k, j in at_kill.items() if not j.finished}
    print(f"killed (SIGKILL) with {len(finished)} of {args.jobs} jobs finished and {len(interrupted)} interrupted")

    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    (work / "second.log").write_text(rerun.stdout + rerun.stderr)
    after = jobs_under(results)
    skipped = rerun.stdout.count("already finished, skipped")

    rows, ok = [], rerun.returncode == 0
    for run_id in sorted(after, key=lambda k: (k not in finished, k not in interrupted, k)):
        before, now = at_kill.get(run_id), after[run_id]
        if run_id in finished:
            state = "finished before the kill"
            passed = (now.done == before.done and now.done_mtime == before.done_mtime
                      and now.runs_mtime == before.runs_mtime)
            check = "kept, not re-run" if passed else "CHANGED: re-run or lost"
        elif run_id in interrupted:
            state = "interrupted by the kill"
            passed = now.finished
            check = "completed by the re-run" if passed else "NOT completed"
        else:
            state = "not started before the kill"
            passed = now.finished
            check = "completed by the re-run" if passed else "NOT completed"
        ok &= passed
        rows.append((run_id, state, check))

    failed = list(results.glob("*/*/failed.json"))
    moved = [p for p in results.glob("*/*") if ".old-" in p.name]
    totals = [("jobs done after the re-run", f"{sum(j.finished for j in after.values())} of {args.jobs}",
               sum(j.finished for j in after.values()) == args.jobs),
              ("re-run reported as skipped", f"{skipped} (finished before the kill: {len(finished)})",
               skipped == len(finished)),
              ("failed.json / folders moved aside", f"{len(failed)} / {len(moved)}", not failed and not moved),
              ("re-run exit status", str(rerun.returncode), rerun.returncode == 0)]
    ok &= all(passed for *_, passed in totals)

    width = max(len(r[1]) for r in rows)
    print(f"\n{'job (run id)':<14}  {'state at the kill':<{width}}  after the re-run")
    for run_id, state, check in rows:
        print(f"{run_id:<14}  {state:<{width}}  {check}")
    print()
    for name, value, passed in totals:
        print(f"{name:<34} {value:<40} {'ok' if passed else 'FAILED'}")
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'}: "
          + ("no finished job lost or re-run; the interrupted job completed" if ok
             else f"see the table above and the logs in {work}"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
