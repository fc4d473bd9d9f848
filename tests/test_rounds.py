"""Rounds: every finished round is on disk as it completes, a re-run measures only what is missing
(with the same code), extra rounds stop when the speedup's interval is narrow enough, and the
quality guardrail marks an arm whose text left the baseline's."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.experiment import job
from ablate.experiment import run as run_module
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.job import run_job
from ablate.experiment.quality_guard import QualityConfig, token_agreement, verdict
from ablate.experiment.run import run_experiment
from ablate.api import EngineConfig, Request, SamplingParams, Sequence
from ablate.model.config import ModelConfig
from ablate.model.llama import LlamaModel
from ablate.workload.requests import WorkloadConfig

SMALL = ["wandb.mode=disabled", "experiment.warmup=0", "workload.num_requests=2", "workload.prompt_len=8",
         "workload.output_len=4", "+experiment.arms.baseline={}", "+experiment.arms.cached.kv_cache=contiguous"]


class Killed(Exception):
    """Stands in for the process dying midway."""


def counting_run_once(monkeypatch, fail_at: int | None = None) -> list[str]:
    calls: list[str] = []
    real = run_module.run_once

    def run_once(arm, *args, **kwargs):
        calls.append(arm.name)
        if fail_at is not None and len(calls) == fail_at:
            raise Killed("the machine went away")
        return real(arm, *args, **kwargs)

    monkeypatch.setattr(run_module, "run_once", run_once)
    return calls


@pytest.mark.slow    # three short jobs end to end
def test_a_killed_job_keeps_its_rounds_and_a_rerun_measures_only_the_rest(compose_config, registry, tmp_path,
                                                                         monkeypatch, capsys):
    raw = compose_config(tmp_path, *SMALL, "experiment.repeats=3")
    counting_run_once(monkeypatch, fail_at=5)         # rounds 0 and 1 finish; round 2 dies in its first arm
    with pytest.raises(Killed):
        run_job(raw, registry)
    folder = next(p for p in (tmp_path / "results" / "default").iterdir() if p.is_dir())   # not its .lock
    kept = pd.read_csv(folder / "runs.csv")
    assert sorted(kept["repeat"].unique()) == [0, 1] and len(kept) == 4
    assert (folder / "failed.json").exists() and not (folder / "done.json").exists()

    calls = counting_run_once(monkeypatch)
    run_job(raw, registry)
    assert "2 round(s) kept" in capsys.readouterr().out
    assert len(calls) == 2                             # round 2 only: one run per arm
    runs = pd.read_csv(folder / "runs.csv")
    assert sorted(zip(runs["arm"], runs["repeat"])) == [(a, r) for a in ("baseline", "cached") for r in range(3)]
    before = kept.set_index(["arm", "repeat"])["duration_s"]
    after = runs.set_index(["arm", "repeat"])["duration_s"].loc[before.index]
    np.testing.assert_array_equal(after, before)       # the kept rounds are the measured ones, not re-measured
    assert (folder / "done.json").exists() and not (folder / "failed.json").exists()
    summary = pd.read_csv(folder / "summary.csv").set_index("arm")
    assert summary.loc["cached", "speedup_rounds"] == 3 and np.isfinite(summary.loc["cached", "speedup_ci_low"])


@pytest.mark.slow
def test_rounds_of_other_code_are_set_aside_not_mixed_in(compose_config, registry, tmp_path, monkeypatch, capsys):
    raw = compose_config(tmp_path, *SMALL, "experiment.repeats=3")
    counting_run_once(monkeypatch, fail_at=3)
    with pytest.raises(Killed):
        run_job(raw, registry)
    monkeypatch.setattr(job, "code_version", lambda: "other-code")
    calls = counting_run_once(monkeypatch)
    folder = run_job(raw, registry)
    assert "rounds measured by other code" in capsys.readouterr().out
    assert len(calls) == 6                             # everything measured again
    aside = [p for p in folder.path.parent.iterdir() if p.name.startswith(folder.path.name + ".old-")]
    assert len(aside) == 1 and len(pd.read_csv(aside[0] / "runs.csv")) == 2      # nothing deleted


def tiny_experiment(registry, arms: dict, models: dict | None = None, **exp_fields):
    exp = ExperimentConfig(name="rounds", arms=arms, warmup=0, **exp_fields)
    plan = [resolve_arm(name, spec, baseline_configs(registry), registry) for name, spec in exp.arms.items()]
    cache: dict[str, LlamaModel] = {}

    def loader(overrides):
        key = repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = LlamaModel.random(ModelConfig(**overrides))
        return cache[key]

    return run_experiment(exp, plan, loader, WorkloadConfig(num_requests=2, prompt_len=8, output_len=6),
                          EngineConfig(max_num_seqs=2), registry, peaks=None, progress=lambda line: None)


def test_extra_rounds_stop_at_the_target_or_the_maximum(registry, monkeypatch):
    real = run_module.run_once           # a perfectly steady 2x: settled after the minimum rounds
    monkeypatch.setattr(run_module, "run_once", lambda arm, *a, **k: _with_duration(
        real(arm, *a, **k), 2.0 if arm.name == "baseline" else 1.0))
    arms = {"baseline": {}, "cached": {"kv_cache": "contiguous"}}
    result = tiny_experiment(registry, arms, repeats=3, max_repeats=8, quality=QualityConfig(enabled=False))
    assert result.runs["repeat"].nunique() == 3
    # noisy: the interval never gets within 0.1%, so rounds go on to the maximum
    noise = iter(np.random.default_rng(0).uniform(0.5, 1.5, 100))
    monkeypatch.setattr(run_module, "run_once", lambda arm, *a, **k: _with_duration(real(arm, *a, **k), next(noise)))
    result = tiny_experiment(registry, arms, repeats=3, max_repeats=6, ci_target=0.001,
                             quality=QualityConfig(enabled=False))
    assert result.runs["repeat"].nunique() == 6


def _with_duration(run, seconds):
    run.row["duration_s"] = seconds
    return run


def test_an_arm_whose_text_left_the_baselines_is_degraded_not_a_speedup(registry):
    arms = {"baseline": {}, "cached": {"kv_cache": "contiguous"}, "other_weights": {"model": {"seed": 7}}}
    result = tiny_experiment(registry, arms, repeats=3)
    summary = result.summary.set_index("arm")
    assert summary.loc["cached", "status"] == "ok" and summary.loc["cached", "token_agreement"] == 1.0
    assert summary.loc["cached", "ppl_ratio"] == pytest.approx(1.0, abs=1e-4)     # a lossless cache
    assert np.isfinite(summary.loc["cached", "speedup"])
    other = summary.loc["other_weights"]
    assert other["status"] == "degraded" and "lost quality" in other["status_detail"]
    assert other["token_agreement"] < 0.5 and math.isnan(other["speedup"])
    assert np.isfinite(other["time_ratio"])            # its time is kept, beside its quality cost
    assert set(result.runs["perplexity"].dropna().index) == set(result.runs.index)   # every round's row has it


def sequence(seq_id: int, prompt: list[int], output: list[int], temperature: float = 0.0) -> Sequence:
    seq = Sequence(Request(seq_id, tuple(prompt), max_new_tokens=len(output),
                           sampling=SamplingParams(temperature=temperature)))
    seq.start()
    seq.advance(len(prompt), output)
    return seq


def test_token_agreement_is_the_common_prefix_share():
    base = [sequence(0, [1], [5, 6, 7, 8]), sequence(1, [2], [9, 9])]
    arm = [sequence(0, [1], [5, 6, 0, 8]), sequence(1, [2], [9, 9])]
    assert token_agreement(base, arm) == pytest.approx((2 / 4 + 1) / 2)
    sampled = [sequence(0, [1], [5], temperature=1.0)]
    assert math.isnan(token_agreement(sampled, sampled))           # sampled text is not compared


def test_verdict_names_what_was_lost():
    cfg = QualityConfig()
    assert verdict(cfg, 1.01, 0.9) == ""
    assert verdict(cfg, 1.80, 0.9) == "lost quality: perplexity x1.80 the baseline's (limit x1.05)"
    assert "agree 10%" in verdict(cfg, 1.0, 0.1)
    with pytest.raises(ValueError, match="context_tokens"):
        QualityConfig(heldout_tokens=8, context_tokens=8)


def test_a_ttft_slo_gives_ttft_goodput_and_attainment_per_round_and_in_the_summary(registry):
    # every TTFT meets a 1000 s SLO; no TPOT meets a 1 ns one (each request emits 6 tokens): the two goodputs part
    result = tiny_experiment(registry, {"baseline": {}}, repeats=2, ttft_slo_ms=1e6, tpot_slo_ms=1e-6,
                             quality=QualityConfig(enabled=False))
    runs = result.runs
    assert (runs["goodput_req_s"] == 0).all() and (runs["ttft_slo_attained"] == 1.0).all()
    assert np.allclose(runs["goodput_ttft_req_s"], 2 / runs["duration_s"])          # 2 requests per round
    row = result.summary.iloc[0]
    assert row["ttft_slo_attained"] == 1.0 and row["goodput_ttft_req_s"] == pytest.approx(
        runs["goodput_ttft_req_s"].median())
    none_set = tiny_experiment(registry, {"baseline": {}}, repeats=1, quality=QualityConfig(enabled=False))
    assert "goodput_ttft_req_s" not in none_set.runs and "ttft_slo_attained" not in none_set.summary
