"""The kit's quality check for plugins that are not exact: perplexity through the plugin's own engine,
against the baseline's, within the plugin's declared bound; and that the check can fail."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ablate.api.plugin import PluginConfig, QualityBound, Slot
from ablate.api.step import StepInputs
from ablate.baselines.no_cache import NoKVCache
from ablate.engine.registry import PluginInfo, Registry
from ablate.measure.quality import perplexity, runner_perplexity
from ablate.testing.declarations import check_declarations
from ablate.testing.quality import arm_perplexity, check_quality, sampled_text


@dataclass
class AmnesiacConfig(PluginConfig):
    name: str = "amnesiac"


class AmnesiacKVCache(NoKVCache):
    """A deliberately broken cache: it claims to keep K/V, so the runner feeds only the new tokens,
    yet keeps none, so every token sees its own step's tokens only (one, when decoding)."""

    name = "amnesiac"
    config_class = AmnesiacConfig
    keeps_kv = True
    exact = False
    quality = QualityBound(max_ratio=1.5, num_tokens=48)

    def prepare(self, step: StepInputs) -> list[int]:
        return list(step.query_lens)                              # the view holds this step's keys only


@pytest.fixture(scope="module")
def registry(ablate_registry) -> Registry:
    info = PluginInfo("kv_cache.amnesiac", f"{__name__}:AmnesiacKVCache", "tests", "loaded", "kv_cache",
                      "amnesiac", AmnesiacKVCache)
    return Registry([*ablate_registry.infos, info])


def test_runner_perplexity_of_the_baseline_is_the_models(ablate_tiny_model, registry):
    """Teacher forcing one token per step through a runner, with or without a cache, scores what
    the bare model scores over the whole text in one pass."""
    ids = sampled_text(registry, ablate_tiny_model, 40)
    whole = perplexity(ablate_tiny_model, ids, window=40, stride=40)
    assert arm_perplexity(registry, {}, ablate_tiny_model, ids) == pytest.approx(whole, rel=1e-5)
    assert arm_perplexity(registry, {"kv_cache": "dynamic"}, ablate_tiny_model, ids) == pytest.approx(whole, rel=1e-5)


def test_runner_perplexity_scores_only_after_the_prefill(ablate_tiny_model, registry):
    from ablate.api.context import EngineConfig
    from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
    from ablate.measure.quality import token_nlls

    ids = sampled_text(registry, ablate_tiny_model, 30)
    built = build_arm(resolve_arm("b", {}, baseline_configs(registry), registry), ablate_tiny_model,
                      EngineConfig(max_num_seqs=1), 30, registry)
    expected = torch.exp(token_nlls(ablate_tiny_model, ids, window=30, stride=30)[9:].double().mean())
    assert runner_perplexity(built.engine.runner, ids, num_prefill=10) == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="num_prefill"):
        runner_perplexity(built.engine.runner, ids, num_prefill=30)


def test_a_plugin_that_destroys_context_fails_its_bound(ablate_tiny_model, registry):
    with pytest.raises(AssertionError, match=r"kv_cache=amnesiac: perplexity [\d.]+ against the baseline's "
                                             r"[\d.]+ over 48 tokens, ratio [\d.]+ exceeds the declared bound 1.5"):
        check_quality(registry, Slot.KV_CACHE, "amnesiac", ablate_tiny_model)


def test_a_bound_it_keeps_passes_and_returns_both_perplexities(ablate_tiny_model, registry, monkeypatch):
    monkeypatch.setattr(AmnesiacKVCache, "quality", QualityBound(max_ratio=100.0, num_tokens=48))
    baseline, got = check_quality(registry, Slot.KV_CACHE, "amnesiac", ablate_tiny_model)
    assert got > 1.5 * baseline            # what the default bound refused: one-token context is costly


def test_a_plugin_that_is_not_exact_must_declare_a_bound(ablate_tiny_model, registry, monkeypatch):
    monkeypatch.setattr(AmnesiacKVCache, "quality", None)
    with pytest.raises(AssertionError, match=r"kv_cache=amnesiac declares exact = False but no quality bound"):
        check_declarations(registry, Slot.KV_CACHE, "amnesiac")


def test_exact_plugins_are_not_scored(ablate_tiny_model, registry):
    assert check_quality(registry, Slot.KV_CACHE, "dynamic", ablate_tiny_model) is None


def test_slots_outside_the_runner_cannot_be_scored(ablate_tiny_model, registry, monkeypatch):
    cls = registry.get(Slot.SCHEDULER, "static")
    monkeypatch.setattr(cls, "exact", False)
    monkeypatch.setattr(cls, "quality", QualityBound(max_ratio=1.1))
    with pytest.raises(AssertionError, match="scheduler=static is not exact, but the kit scores quality"):
        check_quality(registry, Slot.SCHEDULER, "static", ablate_tiny_model)


def test_quality_bound_is_validated():
    with pytest.raises(ValueError, match="metric"):
        QualityBound(max_ratio=1.5, metric="bleu")
    with pytest.raises(ValueError, match="max_ratio must be >= 1"):
        QualityBound(max_ratio=0.9)
    with pytest.raises(ValueError, match="num_tokens must be >= 2"):
        QualityBound(max_ratio=1.5, num_tokens=1)
