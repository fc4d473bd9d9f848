"""A sweep's job in a process of its own, so that a job killed by a signal (the out-of-memory killer's
SIGKILL, a crash in native code) fails alone: the launcher's process, which runs the sweep's other
jobs (Hydra's basic launcher runs them all in one process, joblib's workers several each), waits for
it, records how it ended where a job that fails records its failure (the job's status file, read by
SweepOutcome at the sweep's end, and failed.json in its run folder), and goes on.

The process is a fresh interpreter (`python -m ablate.experiment.job_process`, the job given on its
standard input), neither a fork nor one of multiprocessing's:
- fork copies a process whose torch has run OpenMP parallel regions (the peaks measured before the
  sweep, MeasurePeaksOnce; with the basic launcher, every earlier job), and GNU OpenMP's thread pool
  does not survive a fork: the child can hang in its first parallel region.
- forkserver forks every child from one server, which keeps the environment and standard streams of
  the moment it started: ABLATE_PEAKS_FROZEN (set at the sweep's start) and joblib's per-worker
  OMP_NUM_THREADS would not reach the jobs.
- multiprocessing's spawn starts the child with the parent's start method, and inside joblib's
  workers that is loky's, which a bare interpreter does not know: every job would fail to start.
A fresh interpreter gets this process's environment, working directory and standard streams (the
job's output reaches the console as before). It costs the imports again, seconds per job, small
beside loading a model and measuring its rounds.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ablate.exit_status import describe_exit

GRACE_S = 10.0       # after Ctrl-C, the seconds the job (interrupted as well) has to keep its rounds and exit


def run_sweep_job(raw: dict[str, Any], hydra_config: DictConfig, job_dir: str, debugging: bool) -> None:
    """Run one job of a sweep in a process of its own and wait for it; a death is recorded as its failure."""
    from ablate.report.console import job_prefix

    job = pickle.dumps((raw, int(hydra_config.job.num), job_dir, debugging))
    process = subprocess.Popen([sys.executable, "-m", "ablate.experiment.job_process"], stdin=subprocess.PIPE)
    try:
        process.communicate(job)
    except KeyboardInterrupt:      # the terminal's Ctrl-C reached the job too: let it keep what it measured
        try:
            process.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait()
        raise
    if process.returncode == 0:      # it recorded its own outcome
        return
    why = f"the job's process ended: {describe_exit(process.returncode)}"
    where = record_death(job_dir, why)
    print(f"{job_prefix()}job failed: {why}" + (f"; recorded in {where}" if where else ""), file=sys.stderr, flush=True)


def record_death(job_dir: str, why: str) -> Path | None:
    """The job's status "failed" with `why`; failed.json in its run folder too when it had started one
    and not finished it (a job killed after writing done.json keeps its results). Returns failed.json."""
    from ablate.experiment.sweep_callbacks import write_job_status
    from ablate.results import DONE, RunFolder

    write_job_status(job_dir, "failed", why)
    run_folder = Path(job_dir) / "results"          # the job's link to its run folder (ablate.experiment.job._link)
    if not run_folder.is_dir() or (run_folder / DONE).exists():
        return None
    RunFolder(run_folder.resolve()).finish("failed", error=why)
    return run_folder.resolve() / "failed.json"


def _job_main() -> None:
    """In the job's process: the job from standard input, as Hydra's job number `num` of a multirun
    (its lines' `[job N]` prefix, ablate.report.console.job_prefix), its outcome recorded."""
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    raw, num, job_dir, debugging = pickle.loads(sys.stdin.buffer.read())
    # not the launcher's whole Hydra config: its structured nodes name classes of launcher plugins,
    # which a launcher's worker may hold under another import than pickle finds (joblib's does)
    hydra = OmegaConf.structured(HydraConf)
    hydra.mode, hydra.job.num, hydra.runtime.output_dir = RunMode.MULTIRUN, num, job_dir
    HydraConfig.instance().set_config(OmegaConf.create({"hydra": hydra}))
    if not debugging:               # a warning in one line, as the CLI's own process shows them (ablate.cli.main)
        from ablate.report.console import show_warning
        warnings.showwarning = show_warning
    try:
        run_recorded(raw, job_dir, debugging)
    except KeyboardInterrupt:
        sys.exit(130)


def run_recorded(raw: dict[str, Any], job_dir: str, debugging: bool) -> None:
    """Run the job; whatever becomes of it is written to its status file, and a failure said in one line."""
    from ablate.engine.registry import default_registry
    from ablate.experiment.baseline_failure import recorded_baseline_failure
    from ablate.experiment.job import run_job
    from ablate.experiment.sweep_callbacks import write_job_status
    from ablate.report.console import job_prefix

    try:
        folder = run_job(raw, default_registry(), swallow_errors=True, job_dir=job_dir)
    except Exception as err:     # raised before measuring (a config error, a locked folder)
        if debugging:
            traceback.print_exc()
        bad_config = isinstance(err, ValueError)      # the sweep goes on with its other jobs
        message = " ".join(str(err).split()) or type(err).__name__
        message = message if bad_config else f"{type(err).__name__}: {message}"
        print(f"{job_prefix()}{'error' if bad_config else 'job failed'}: {message}", file=sys.stderr, flush=True)
        write_job_status(job_dir, "config error" if bad_config else "failed", message)
        return
    if folder is None:
        write_job_status(job_dir, "failed", f"see {job_dir}/results/failed.json")
    elif (why := recorded_baseline_failure(folder.path)) is not None:    # finished, but compared nothing
        print(f"{job_prefix()}job failed: {why}", file=sys.stderr, flush=True)
        write_job_status(job_dir, "failed", why)
    else:
        write_job_status(job_dir, "done")


if __name__ == "__main__":
    _job_main()
