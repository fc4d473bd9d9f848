"""A job's safety nets: one process at a time per run folder, a plugin that calls sys.exit fails its
arm only, and a sweep says which jobs failed and exits non-zero."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

from ablate.experiment.job import run_identity, run_job
from ablate.results import RunFolder, RunLocked
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache
from broken_plugins import config

SMALL = ["wandb.mode=disabled", "experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2",
         "workload.prompt_len=8", "workload.output_len=4"]


class ExitsTheProcess(ContiguousKVCache):
    """A plugin that ends the process from inside the engine."""
    name = "exits"
    config_class = config(ContiguousConfig, name)

    def prepare(self, step):
        sys.exit(3)


def test_a_second_process_on_the_same_config_is_refused(compose_config, registry, tmp_path):
    raw = compose_config(tmp_path, *SMALL)
    folder = RunFolder.for_config(tmp_path / "results", raw["experiment"]["name"], run_identity(raw, torch.device("cpu")))
    with folder.lock():                        # stands in for another process measuring it now
        with pytest.raises(RunLocked, match="is measuring this config right now"):
            run_job(raw, registry)
        assert not (folder.path / "runs.csv").exists()
    assert run_job(raw, registry).is_done      # released: the next run measures


def test_a_plugin_calling_sys_exit_fails_its_arm_only(compose_config, ablate_registry, tmp_path):
    registry = ablate_registry.with_plugins(ExitsTheProcess)
    raw = compose_config(tmp_path, *SMALL, "+experiment.arms.base={}", "+experiment.arms.bad.kv_cache=exits")
    folder = run_job(raw, registry, swallow_errors=True)       # no SystemExit escapes; the job finishes
    summary = pd.read_csv(folder.path / "summary.csv").set_index("arm")
    assert summary.loc["base", "status"] == "ok"
    assert summary.loc["bad", "status"] == "failed"
    assert summary.loc["bad", "status_detail"].startswith("kv_cache=exits.prepare: SystemExit: 3")


@pytest.mark.slow     # two short jobs through the CLI (~10 s)
def test_a_sweep_with_a_failed_job_lists_it_and_exits_1(tmp_path):
    cmd = [sys.executable, "-m", "ablate", "-m", "model=tiny", "device=cpu", "threads=1", "peak_bandwidth=1e10",
           "peak_flops=1e11", *SMALL, "experiment.repeats=3,0", f"results_dir={tmp_path}/results",
           f"hydra.sweep.dir={tmp_path}/sweep"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "sweep: 1 of 2 jobs did not finish" in out.stdout
    assert "[job 1] config error: experiment.repeats must be >= 1" in out.stdout
    assert (tmp_path / "sweep" / "0" / "results" / "done.json").exists()      # the job folder links its run
