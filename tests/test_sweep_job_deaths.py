"""A sweep job killed by a signal (the out-of-memory killer's SIGKILL, a native crash's SIGSEGV or
SIGABRT) fails that job only, under every launcher: the other jobs run, the dead one is recorded as
failed with its signal named (its job status, its failed.json, the sweep's closing list) and the
sweep exits 1. And a run whose baseline arm failed exits non-zero, saying so in one line.

The deaths come from a third-party plugin installed the way a user's would be (a distribution on
the path, found through its entry point): a scheduler that sends its own process a signal."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ablate.exit_status import describe_exit

FAST = ["model=tiny", "experiment.repeats=1", "experiment.warmup=0", "workload.num_requests=2",
        "workload.output_len=3", "device=cpu", "threads=1", "peak_bandwidth=1e10", "peak_flops=1e11",
        "wandb.mode=disabled", "experiment.quality.enabled=false"]

DYING_SCHEDULER = '''
import os
from dataclasses import dataclass

from ablate.baselines.static_scheduler import StaticScheduler, StaticSchedulerConfig


@dataclass
class DyingConfig(StaticSchedulerConfig):
    name: str = "dying"
    signal: int = 0       # > 0: the signal its process gets at its first batch; -1: that batch raises; 0: none


class Dying(StaticScheduler):
    name = "dying"
    config_class = DyingConfig

    def next_batch(self):
        if self.config.signal > 0:
            os.kill(os.getpid(), self.config.signal)
        if self.config.signal < 0:
            raise RuntimeError("broken on purpose")
        return super().next_batch()
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the dying scheduler's distribution (module and .dist-info), for PYTHONPATH."""
    site = tmp_path_factory.mktemp("site")
    (site / "ablate_test_dying.py").write_text(DYING_SCHEDULER)
    info = site / "ablate_test_dying-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ablate-test-dying\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ablate.plugins]\nscheduler.dying = ablate_test_dying:Dying\n")
    return site


def ablate(tmp_path: Path, site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "ablate", *args, *FAST, f"results_dir={tmp_path / 'results'}",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


SIGNALS = [signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT]
LAUNCHERS = {"basic": [], "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_job_killed_by_a_signal_fails_alone_and_the_sweep_goes_on(tmp_path, site, launcher):
    values = ",".join(str(int(s)) for s in [*SIGNALS, 0])     # the good job after the deaths
    out = ablate(tmp_path, site, "-m", *LAUNCHERS[launcher], "scheduler=dying", f"scheduler.signal={values}")
    assert out.returncode == 1, out.stderr[-3000:]
    jobs = len(SIGNALS) + 1
    assert f"sweep: {len(SIGNALS)} of {jobs} jobs did not finish" in out.stdout, out.stdout[-3000:]
    assert len(list((tmp_path / "results").rglob("done.json"))) == 1       # the good one ran, after the deaths
    statuses = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "multirun").glob("*/ablate_job.json")}
    assert len(statuses) == jobs
    failed = sorted(s["error"] for s in statuses.values() if s["status"] == "failed")
    expected = sorted(f"the job's process ended: {describe_exit(-int(s))}" for s in SIGNALS)
    assert failed == expected
    assert "killed by SIGKILL (out of memory?)" in out.stdout and "killed by SIGSEGV" in out.stdout
    records = [json.loads(p.read_text()) for p in (tmp_path / "results").rglob("failed.json")]
    assert sorted(r["error"] for r in records) == expected       # each dead job's run folder says how it died
    assert "TerminatedWorkerError" not in out.stderr and "Traceback" not in out.stderr


def test_exit_codes_are_named_with_their_likely_cause():
    assert describe_exit(-9) == "killed by SIGKILL (out of memory?)"
    assert describe_exit(-11) == "killed by SIGSEGV (a crash in native code)"
    assert describe_exit(-int(signal.SIGTERM)) == "killed by SIGTERM"
    assert describe_exit(-200) == "killed by signal 200"
    assert describe_exit(3) == "exited with status 3"


@pytest.mark.slow
def test_a_run_whose_baseline_failed_exits_non_zero_in_one_line(tmp_path, site):
    arms = ["+experiment.arms.only.scheduler.name=dying", "+experiment.arms.only.scheduler.signal=-1"]
    out = ablate(tmp_path, site, *arms)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the baseline arm 'only' failed (") and "broken on purpose" in last, last
    assert "no arm could be compared with it" in last and "Traceback" not in out.stderr
    again = ablate(tmp_path, site, *arms)                      # skipped as finished: the same verdict
    assert "already finished, skipped" in again.stdout and again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == last
