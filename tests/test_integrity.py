"""Measurement integrity: an arm whose plugin breaks the contract is reported as failed, one that
declares itself exact but diverges from the baseline as diverged, neither with a speedup; a
failure inside a plugin is an error naming the plugin and the method."""
from __future__ import annotations

import math

import pytest

from ablate.api import EngineConfig, PluginError, Request
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.run import run_experiment
from ablate.report.tables import summary_table
from ablate.workload.requests import WorkloadConfig
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache
from broken_plugins import DropsArrivals, WrongGreedyToken, config


class WriteOutOfRange(ContiguousKVCache):
    """Writes past its buffer once sequences are long: a bare IndexError inside the plugin."""
    name = "write_out_of_range"
    config_class = config(ContiguousConfig, name)

    def prepare(self, step):
        super().prepare(step)
        step.plan["write_index"] = step.plan["write_index"] + self.k.shape[1] * self.capacity


@pytest.fixture(scope="module")
def registry(ablate_registry):
    return ablate_registry.with_plugins(DropsArrivals, WrongGreedyToken, WriteOutOfRange)


def experiment(registry, model, arms: dict) -> object:
    exp = ExperimentConfig(name="integrity", arms=arms, repeats=2, warmup=0)
    plan = [resolve_arm(name, spec, baseline_configs(registry), registry) for name, spec in exp.arms.items()]
    workload = WorkloadConfig(num_requests=6, prompt_len=8, output_len=6)
    return run_experiment(exp, plan, lambda overrides: model, workload, EngineConfig(max_num_seqs=4), registry,
                          peaks=None, progress=lambda line: None)


def test_an_arm_that_loses_requests_is_failed_not_a_speedup(registry, ablate_tiny_model):
    result = experiment(registry, ablate_tiny_model, {"baseline": {}, "lossy": {"scheduler": "drops_arrivals"},
                                                      "cached": {"kv_cache": "contiguous"}})
    summary = result.summary.set_index("arm")
    assert summary.loc["lossy", "status"] == "failed" and math.isnan(summary.loc["lossy", "speedup"])
    assert "drops_arrivals.has_unfinished" in summary.loc["lossy", "status_detail"]
    assert summary.loc["cached", "status"] == "ok" and summary.loc["cached", "speedup"] > 0   # the others measured
    assert list(result.runs[result.runs["arm"] == "lossy"]["status"]) == ["failed", "failed"]   # not run again
    table = summary_table(result.summary, [])
    assert table.set_index("arm").loc["lossy", "speedup [95% CI]"] == "FAILED"
    assert table.set_index("arm").loc["lossy", "status"].startswith("FAILED: scheduler=drops_arrivals")


def test_an_exact_arm_that_diverges_from_the_baseline_is_flagged(registry, ablate_tiny_model):
    result = experiment(registry, ablate_tiny_model, {"baseline": {}, "wrong": {"decoding": "wrong_greedy"},
                                                      "sdpa": {"attention": "sdpa"}})
    summary = result.summary.set_index("arm")
    assert summary.loc["wrong", "status"] == "diverged" and math.isnan(summary.loc["wrong", "speedup"])
    assert "declared exact, but 1 of 6 greedy requests differ" in summary.loc["wrong", "status_detail"]
    assert summary.loc["sdpa", "status"] == "ok" and summary.loc["sdpa", "baseline_agreement"] == 1.0


def test_a_failure_inside_a_plugin_names_it_and_the_method(registry, ablate_tiny_model):
    arm = resolve_arm("x", {"kv_cache": "write_out_of_range"}, baseline_configs(registry), registry)
    built = build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=2), 16, registry)
    with pytest.raises(PluginError, match=r"^kv_cache=write_out_of_range\.write: layer 0: (IndexError|RuntimeError)"):
        built.engine.run([Request(0, (1, 2, 3), 4)])


def test_a_sequence_cannot_be_changed_by_a_plugin():
    from ablate.api import Sequence
    seq = Sequence(Request(0, (1, 2, 3), 4))
    with pytest.raises(AttributeError):
        seq.num_computed_tokens = 2            # progress is the engine's: read-only for plugins
    with pytest.raises(AttributeError):
        seq.status = None
