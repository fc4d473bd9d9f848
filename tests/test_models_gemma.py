"""Gemma 2 and Gemma 3 (text) checkpoints, and sliding windows applied (Gemma, Mistral, Qwen2).

Random transformers models (ablate.testing.hf_models) with windows of 8 tokens, shorter than every
prompt here, so that a window not applied, or applied off by one, changes the logits: ours within
1e-3 of transformers' in fp32, the greedy text identical, through the engine's caches and attention
plugins too. An attention plugin that lacks a feature the model needs is refused at build time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from ablate.analysis.costs import CostsConfig, cost_tables, model_costs
from ablate.analysis.devices import server_spec
from ablate.analysis.servers import ServerCosts
from ablate.api import Attention, PluginConfig, causal_mask
from ablate.checkpoints import load_model
from ablate.engine.arm import IncompatiblePlugins, check_attention_features
from ablate.measure.quality import sequence_logits
from ablate.model.config import ModelConfig
from ablate.model.presets import preset
from ablate.testing.hf_models import greedy, hf_logits, SMALL
from test_model import make_step

pytest.importorskip("transformers")

TOL = 1e-3               # max |logit difference| in fp32
NEW_TOKENS = 24
WINDOW = 8               # the kinds' sliding_window


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_gemma_config_is_read_as_transformers_applies_it(pairs):
    g2, _ = pairs("gemma2")
    c = g2.config
    assert (c.scale_embeddings, c.post_norms, c.mlp_activation, c.tied_embeddings) == (True, True, "gelu_tanh", True)
    assert (c.attn_softcap, c.final_softcap, c.qk_norm) == (20.0, 50.0, False)
    assert (c.sliding_window, c.window_layers) == (WINDOW, [0, 2])          # every other layer, from the first
    g3, _ = pairs("gemma3")
    c = g3.config
    assert c.qk_norm and (c.attn_softcap, c.final_softcap) == (0.0, 0.0)
    assert (c.window_layers, c.rope_base, c.rope_local_base, c.rope_linear_factor) == ([0, 1, 3], 1e6, 1e4, 2.0)
    assert [layer.local_rope for layer in g3.layers] == [True, True, False, True]


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral-window", "qwen2-window"])
def test_logits_and_greedy_text_match_transformers_past_the_window(kind, pairs):
    model, hf = pairs(kind)
    ids = prompt(3 * WINDOW)
    diff = (sequence_logits(model, ids) - hf_logits(hf)(ids)).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit diff| {diff:.2e}"
    assert greedy(lambda t: sequence_logits(model, t), ids, NEW_TOKENS) == greedy(hf_logits(hf), ids, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["mistral-window", "gemma2"])
def test_the_window_changes_the_logits(kind, pairs):
    """With the windows taken off the layers the logits differ past the window (and only there): the
    test above tests the window."""
    model, hf = pairs(kind)
    unwindowed = load_model(ModelConfig(name="checkpoint", init="pretrained", path=model.checkpoint_notes["path"]))
    for layer in unwindowed.layers:
        features = layer.attn.features
        layer.attn.features = None if features is None or features.softcap is None else replace(features, window=None)
    ids = prompt(3 * WINDOW)
    full, windowed = sequence_logits(unwindowed, ids), sequence_logits(model, ids)
    assert (full[:WINDOW] - windowed[:WINDOW]).abs().max() < TOL
    assert (full - hf_logits(hf)(ids)).abs().max() > 1e-2


ENGINE_CASES = [pytest.param("gemma2", "contiguous", "naive"), pytest.param("gemma3", "contiguous", "sdpa"),
                pytest.param("gemma2", "contiguous", "sdpa"), pytest.param("qwen2-window", "contiguous", "naive"),
                pytest.param("gemma3", "none", "naive", marks=pytest.mark.slow),
                pytest.param("gemma2", {"name": "paged", "block_size": 4}, "paged", marks=pytest.mark.slow),
                pytest.param("gemma3", {"name": "paged", "block_size": 4}, "paged", marks=pytest.mark.slow),
                pytest.param("gemma3", {"name": "dynamic", "initial_tokens": 4}, "naive", marks=pytest.mark.slow),
                pytest.param("mistral-window", {"name": "paged", "block_size": 4}, "sdpa", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, kv_cache, attention", ENGINE_CASES)
def test_the_engine_decodes_transformers_greedy_text(kind, kv_cache, attention, pairs, build, make_requests):
    """Two sequences of different lengths in one batch, past the window in the prefill and in every
    decode step, whatever the cache keeps and whichever attention reads it."""
    model, hf = pairs(kind)
    prompts = [prompt(3 * WINDOW, seed=2), prompt(3 * WINDOW + 5, seed=3)]
    requests = [replace(r, prompt_token_ids=tuple(p)) for r, p in zip(make_requests([24, 29], NEW_TOKENS), prompts)]
    seqs = build({"kv_cache": kv_cache, "attention": attention}, model, record=False).engine.run(requests)
    for seq, ids in zip(sorted(seqs, key=lambda s: s.request.request_id), prompts):
        assert seq.output_token_ids == greedy(hf_logits(hf), ids, NEW_TOKENS)


@dataclass
class PlainConfig(PluginConfig):
    name: str = "plain"


class PlainAttention(Attention):
    """A third party's attention written before windows existed: it declares no features."""

    name = "plain"
    config_class = PlainConfig

    def __call__(self, q, view, step):
        raise AssertionError("never called: the build refuses the model")


def test_an_attention_plugin_lacking_a_feature_is_refused_naming_it_and_the_layers(pairs):
    model, _ = pairs("gemma2")
    with pytest.raises(IncompatiblePlugins, match=r"attention=plain does not support sliding_window \(layers 0, 2\); "
                                                  r"softcap \(layers 0, 1, 2, 3\)"):
        check_attention_features(PlainAttention, model)
    check_attention_features(PlainAttention, load_model(preset("tiny")))    # no window, no cap: it runs


def test_flash_is_refused_for_a_windowed_model_before_it_is_built(pairs, build):
    model, _ = pairs("mistral-window")
    with pytest.raises(IncompatiblePlugins, match=r"attention=flash does not support sliding_window \(layers 0, 1\)"):
        build({"kv_cache": "contiguous", "attention": "flash"}, model)


def test_kv_bytes_of_a_windowed_model_count_each_windowed_layer_up_to_its_window(pairs):
    model, _ = pairs("gemma3")          # layers 0, 1, 3 slide over 8 tokens; layer 2 keeps every token
    c = model.config
    per_layer_token = 2 * c.n_kv_heads * c.head_dim * 4                  # K and V, fp32
    assert c.kv_bytes_per_token() == 4 * per_layer_token
    assert c.kv_bytes_at(5) == 5 * c.kv_bytes_per_token()                 # within the window: every token
    assert c.kv_bytes_at(100) == (3 * WINDOW + 100) * per_layer_token
    plain = preset("tiny")
    assert plain.kv_bytes_at(100) == 100 * plain.kv_bytes_per_token()


def test_the_cost_tables_memory_figures_count_the_windows():
    windowed = model_costs({"preset": "tiny", "sliding_window": 8, "window_layers": [0]}, "fp32")
    full = model_costs({"preset": "tiny"}, "fp32")
    per_layer_token = full.kv_bytes_per_token // 2
    assert windowed.kv_bytes_per_token == full.kv_bytes_per_token
    assert windowed.kv_bytes_at(100) == (8 + 100) * per_layer_token and full.kv_bytes_at(100) == 200 * per_layer_token
    assert windowed.decode_bytes_per_token(100) == windowed.active_weight_bytes + (8 + 100) * per_layer_token
    # on a server of two devices (one K/V head each): a request at context 100 holds 108 tokens' K/V
    # of the windowed model, 200 of the other
    on_two, full_on_two = (ServerCosts(m, server_spec("2xh100-sxm")) for m in (windowed, full))
    assert on_two.kv_bytes_per_request(100) == (8 + 100) * per_layer_token
    assert full_on_two.kv_bytes_per_request(100) == 100 * full.kv_bytes_per_token
    assert on_two.max_requests(100) == on_two.memory_left_per_device // ((8 + 100) * per_layer_token // 2)
    rows = cost_tables(CostsConfig(models=[{"preset": "tiny", "sliding_window": 8, "window_layers": [0]}],
                                   context_lens=[100], dtype="fp32"), {"h100-sxm": server_spec("h100-sxm")})
    assert rows["models"]["kv_bytes_at_100"].item() == (8 + 100) * per_layer_token
    assert rows["devices"]["kv_bytes_per_request_at_100"].item() == (8 + 100) * per_layer_token


def test_a_gemma2_checkpoint_converted_to_fewer_kv_heads_keeps_its_norms_and_windows(pairs, build, make_requests):
    """variant=gqa rebuilds the attention and shares the rest: the post-norms and windows come along."""
    model, _ = pairs("gemma2")
    built = build({"kv_cache": "contiguous", "variant": {"name": "gqa", "kv_heads": 1}}, model, record=False)
    converted = built.engine.runner.model
    assert converted.config.n_kv_heads == 1 and converted.layers[0].attn_post_norm is model.layers[0].attn_post_norm
    assert converted.layers[0].attn.features == model.layers[0].attn.features
    (seq,) = built.engine.run(make_requests([3 * WINDOW], 4))
    assert len(seq.output_token_ids) == 4


def test_the_window_mask_in_a_ragged_step_and_in_a_captured_decode_step():
    """Query p sees keys p - W + 1 .. p; a padded query row still sees a key (no NaN rows); a decode
    step captured for replay (built from kv_lens_t only) masks as the same step uncaptured."""
    step = make_step([3, 1], [12, 5])                      # queries at positions 9..11, and 4
    mask = causal_mask(step, 12, window=4)                  # (B, Lq, S)
    assert mask[0, 0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert mask[0, 2].nonzero().flatten().tolist() == [8, 9, 10, 11]
    assert mask[1, 0].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert mask[1].any(dim=-1).all()                        # the padded rows of the one-query sequence
    decode = make_step([1, 1], [12, 5])
    graphed = replace(decode, graphed=True, _memo={})
    assert torch.equal(causal_mask(graphed, 16, window=4), causal_mask(decode, 16, window=4))


def test_a_job_is_refused_before_its_model_loads_when_an_arm_lacks_a_feature(pairs, compose_config, registry,
                                                                             tmp_path, monkeypatch):
    """make_plan reads the checkpoint's config.json (no weights) and refuses the flash arm."""
    from ablate.checkpoints import loader
    from ablate.experiment.config import to_run_config
    from ablate.experiment.plan import make_plan

    model, _ = pairs("mistral-window")
    path = model.checkpoint_notes["path"]
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = to_run_config(compose_config(tmp_path, f"model.path={path}", "kv_cache=contiguous", "attention=flash"),
                        registry)
    with pytest.raises(IncompatiblePlugins, match=r"attention=flash does not support sliding_window \(layers 0, 1\)"):
        make_plan(cfg, registry)
    cfg = to_run_config(compose_config(tmp_path, f"model.path={path}", "kv_cache=contiguous", "attention=sdpa"),
                        registry)
    assert len(make_plan(cfg, registry).arms) == 2
