"""Sweeps through the CLI: Hydra's submitit launcher (local mode), failures, and resumption."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAST = ["model=tiny", "kv_cache=contiguous", "experiment.repeats=1", "experiment.warmup=0",
        "workload.num_requests=2", "device=cpu", "threads=1", "peak_bandwidth=1e10", "peak_flops=1e11",
        "wandb.mode=disabled"]


def ablate(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "ablate", "-m", *FAST, f"results_dir={tmp_path / 'results'}",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def finished(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "results").rglob("done.json"))


@pytest.mark.slow
def test_submitit_local_sweep_runs_every_job(tmp_path):
    out = ablate(tmp_path, "hydra/launcher=submitit_local", "workload.output_len=3,5")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(finished(tmp_path)) == 2


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on_and_resumes(tmp_path):
    # output_len=4000 exceeds the tiny model's 1024-token RoPE table: that job fails at run time
    out = ablate(tmp_path, "workload.output_len=3,4000,5")
    assert out.returncode == 1, out.stderr[-2000:]        # the sweep went on, and says a job failed
    assert "sweep: 1 of 3 jobs did not finish" in out.stdout
    assert len(finished(tmp_path)) == 2
    failed = list((tmp_path / "results").rglob("failed.json"))
    assert len(failed) == 1 and "max_seq_len" in failed[0].read_text()
    stamps = {p: p.stat().st_mtime_ns for p in finished(tmp_path)}

    again = ablate(tmp_path, "workload.output_len=3,4000,5")     # re-run: finished jobs are skipped
    assert again.stdout.count("already finished, skipped") == 2
    assert {p: p.stat().st_mtime_ns for p in finished(tmp_path)} == stamps
