"""The plugin's config (validation, Hydra composition), its drafter pieces and its stats arithmetic."""
from __future__ import annotations

import math

import pytest

from ablate.api.plugin import Slot
from ablate.model.presets import preset
from ablate_decoding.acceptance import accept_greedy
from ablate_decoding.draft_models import draft_model_config, layer_skip_layers, layer_subset
from ablate_decoding.ngram import NgramDrafter, lookup
from ablate_decoding.spec_stats import SpeculativeStats, expected_tokens_per_pass, predicted_speedup
from ablate_decoding.speculative import SpeculativeConfig


@pytest.mark.parametrize("fields, field_named", [
    ({"k": 0}, "decoding.k"),
    ({"drafter": "medusa"}, "decoding.drafter"),
    ({"drafter": "draft_model"}, "decoding.draft_model"),
    ({"ngram_n": 0}, "decoding.ngram_n"),
    ({"exit_layer": 0}, "decoding.exit_layer"),
    ({"skip_every": 0}, "decoding.skip_every"),
])
def test_config_errors_name_the_field(fields, field_named):
    with pytest.raises(ValueError, match=field_named):
        SpeculativeConfig(**fields)


def test_draft_model_must_share_the_vocabulary(build, target):
    spec = {"kv_cache": "contiguous", "decoding": {"name": "speculative", "drafter": "draft_model",
                                                   "draft_model": "tiny", "draft_overrides": {"vocab_size": 300}}}
    with pytest.raises(ValueError, match="vocabulary"):
        build(spec, target)


def test_draft_model_config():
    target = preset("smollm2-135m", init="pretrained", dtype="bf16")
    cfg = draft_model_config("smollm2-135m", target, {})
    assert cfg.init == "pretrained" and cfg.dtype == "bf16"      # a checkpoint preset takes the target's init
    assert draft_model_config("tiny", target, {"seed": 3}).init == "random"
    with pytest.raises(ValueError, match="decoding.draft_model"):
        draft_model_config("no-such-model", target, {})


def test_early_exit_exceeding_the_target_is_refused(build, target):
    with pytest.raises(ValueError, match="decoding.exit_layer"):
        build({"decoding": {"name": "speculative", "drafter": "early_exit", "exit_layer": 9}}, target)


def test_composes_with_hydra(registry):
    """`decoding=speculative decoding.k=8 ...` on the command line gives the validated config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ablate.engine.config_store import register_configs
    from ablate.engine.registry import conf_dir
    from ablate.experiment.config import to_run_config

    register_configs(registry)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "decoding=speculative", "decoding.k=8", "decoding.drafter=draft_model", "decoding.draft_model=tiny",
            "+decoding.draft_overrides.seed=1", "results_dir=unused"])
    plugins = to_run_config(OmegaConf.to_container(cfg, resolve=True), registry).plugins
    assert plugins[Slot.DECODING] == SpeculativeConfig(k=8, drafter="draft_model", draft_model="tiny",
                                                        draft_overrides={"seed": 1})


def test_ngram_lookup():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(tokens, 3, 2) == [7, 8]            # the most recent earlier match wins
    assert lookup(tokens, 3, 9) == [7, 8, 1, 2, 3]   # up to what follows it
    assert lookup([5, 6, 7], 2, 4) == []             # no earlier occurrence
    assert lookup([4, 4, 4], 1, 3) == [4]            # overlapping occurrences are fine


def test_ngram_drafter_falls_back_to_shorter_matches():
    tokens = [1, 2, 3, 9, 5, 3]                       # (5, 3) never occurred before, 3 did
    assert NgramDrafter(2, 2).draft(tokens, 2) == []
    assert NgramDrafter(2, 1).draft(tokens, 2) == [9, 5]
    assert NgramDrafter(3, 1).draft([1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 1) == [7]   # the longest match first


def test_greedy_rule():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]).tokens == [5, 6, 7]      # correction at the mismatch
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]).tokens == [5, 6, 7, 8]   # all accepted: the bonus token
    assert accept_greedy([5], []).tokens == [5]                            # no drafts: autoregressive


def test_layer_subset_shares_the_target_weights(target):
    layers = layer_skip_layers(4, 2)
    assert layers == [0, 2, 3]
    draft = layer_subset(target, layers, "every2")
    assert draft.config.n_layers == 3
    assert draft.layers[1].attn.wqkv.weight.data_ptr() == target.layers[2].attn.wqkv.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()


@pytest.mark.parametrize("layers", [[0], [1], [1, 2], [0, 2, 3], [3]])
@pytest.mark.parametrize("shape", [
    {"sliding_window": 8, "window_layers": [0, 2]},               # alternating windows (Gemma 2)
    {"sliding_window": 8, "window_layers": None},                 # every layer slides (Mistral)
    {"sliding_window": 8, "window_layers": [1, 2, 3], "rope_local_base": 10_000.0},   # Gemma 3's local RoPE
    {"name": "moe-tiny", "n_layers": 4, "dense_layers": [0, 3]},  # dense layers between MoE ones
])
def test_a_layer_subset_keeps_what_each_of_its_layers_is(layers, shape):
    """A self-speculative draft running layers [a, b, ...] of the target: its layer i slides, caps
    and routes exactly as the target's layer layers[i] (fields that name layers are renumbered)."""
    from ablate.model.llama import LlamaModel

    fields = dict(shape)
    target = preset(fields.pop("name", "tiny"), **{"n_layers": 4, **fields})
    draft = layer_subset(LlamaModel.random(target), layers, "draft").config
    assert draft.n_layers == len(layers)
    for new, old in enumerate(layers):
        assert draft.layer_attention(new) == target.layer_attention(old)
        assert draft.is_moe_layer(new) == target.is_moe_layer(old)


def test_stats_arithmetic():
    stats = SpeculativeStats(k=4)
    stats.record_verification(0, 4, 4, 5)    # all accepted, bonus token
    stats.record_verification(1, 4, 1, 2)    # position 2 rejected
    stats.record_verification(0, 2, 0, 1)    # fewer drafts (near the end), the first rejected
    d = stats.as_dict()
    assert d["proposed_tokens"] == 10 and d["accepted_tokens"] == 5
    assert d["acceptance_rate"] == pytest.approx(0.5)
    assert d["alpha"] == pytest.approx(5 / 7)                  # tested: 4 + 2 + 1
    assert d["acceptance_by_position"] == "0.667 0.500 1.000 1.000"
    assert d["tokens_per_target_forward"] == pytest.approx(8 / 3)
    assert stats.log[1] == (0, 1, 4, 1, 2)                     # (step, seq_id, proposed, accepted, emitted)
    stats.record_step(draft_s=0.004, target_s=0.010)
    assert stats.cost_ratio == pytest.approx(0.1)              # k c = draft / target time


def test_predicted_speedup():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    # Leviathan et al.: alpha 0.8, k 4, c 0.05 -> (1 - 0.8^5) / (0.2 * 1.2) = 2.8
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert math.isnan(predicted_speedup(math.nan, 4, 0.1))


def test_stats_keys_are_stable(build, target, make_requests):
    """stats() returns exactly the keys of `reported_stats`, before any step and after a run."""
    built = build({"kv_cache": "contiguous", "decoding": {"name": "speculative", "drafter": "early_exit",
                                                          "exit_layer": 2}}, target)
    decoding = built.plugins[Slot.DECODING]
    declared = {stat.key for stat in decoding.reported_stats}
    assert set(decoding.stats()) == declared
    built.engine.run(make_requests([7, 9], [5, 6]))
    stats = decoding.stats()
    assert set(stats) == declared
    assert stats["draft_passes"] > 0 and stats["draft_kv_reserved_bytes"] > 0
