"""The Llama decoder: presets and parameter counts, head layouts, naive attention, RoPE, config checks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ablate.api import BuildContext, EngineConfig, KVSpec
from ablate.api.kv import PackedKV, PaddedKV
from ablate.api.sequence import Request, Sequence
from ablate.api.step import Batch, StepInputs
from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate.baselines.no_cache import NoKVCache, NoKVCacheConfig
from ablate.experiment.config import build as build_dataclass
from ablate.model.config import ModelConfig
from ablate.model.presets import PRESETS, preset
from ablate.model.forward import Forward
from ablate.model.llama import LlamaModel


def unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())    # parameters() yields a tied tensor once


# -- presets -----------------------------------------------------------------------------------------

def test_tiny_preset(tiny_model):
    cfg = tiny_model.config
    shape = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert shape == (2, 64, 4, 2, 16, 256)
    assert not cfg.tied_embeddings and tiny_model.lm_head.weight is not tiny_model.embed.weight
    # 2 x (QKV 64x128 + O 64x64 + SwiGLU 3x64x176 + 2 norms) + final norm + untied embeddings and head
    expected = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64 + 2 * 256 * 64
    assert cfg.num_params() == unique_params(tiny_model) == expected == 125_248


def test_smollm2_135m_parameter_count():
    cfg = preset("smollm2-135m")
    assert cfg.num_params() == 134_515_008          # SmolLM2-135M, tied embeddings counted once
    assert cfg.head_dim == 64 and cfg.tied_embeddings
    with torch.device("meta"):                      # the shapes only: no memory, no init
        model = LlamaModel(cfg)
    assert model.lm_head.weight is model.embed.weight
    assert unique_params(model) == 134_515_008


def test_shape_only_presets_count_but_refuse_to_instantiate():
    assert preset("llama-2-70b").num_params() == 68_976_648_192      # Llama-2-70B's published count
    assert 174e9 < preset("gpt-3-175b").num_params() < 176e9
    for name in ("llama-2-70b", "gpt-3-175b"):
        cfg = preset(name)
        assert cfg.shape_only
        with pytest.raises(ValueError, match=rf"model '{name}' is shape-only.*pick an instantiable preset"):
            LlamaModel.random(cfg)
        with torch.device("meta"), pytest.raises(ValueError, match="shape-only"):
            LlamaModel(cfg)


def test_preset_lookup():
    assert preset("tiny", n_layers=3).n_layers == 3
    assert PRESETS["tiny"].n_layers == 2                 # a copy: the preset itself is unchanged
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*smollm2-135m"):
        preset("nope")


def test_random_weights_are_seeded():
    a, b = LlamaModel.random(preset("tiny")), LlamaModel.random(preset("tiny"))
    c = LlamaModel.random(preset("tiny", seed=1))
    assert torch.equal(a.layers[0].attn.wqkv.weight, b.layers[0].attn.wqkv.weight)
    assert not torch.equal(a.layers[0].attn.wqkv.weight, c.layers[0].attn.wqkv.weight)


# -- head layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_head_layouts_run(n_kv_heads, build, make_requests):
    model = LlamaModel.random(preset("tiny", n_kv_heads=n_kv_heads))
    assert model.layers[0].attn.wqkv.out_features == (4 + 2 * n_kv_heads) * 16
    requests = make_requests([3, 11, 17], [5, 2, 7])
    recompute = build({"kv_cache": "none"}, model).engine.run(requests)
    built = build({"kv_cache": "contiguous"}, model)
    cached = built.engine.run(requests)
    assert [s.num_output_tokens for s in cached] == [5, 2, 7]
    assert [s.output_token_ids for s in cached] == [s.output_token_ids for s in recompute]
    assert built.kv_cache.spec.bytes_per_token == 2 * 2 * n_kv_heads * 16 * 4
    assert built.kv_cache.k.shape[-2:] == (n_kv_heads, 16)


# -- naive attention against a reference ---------------------------------------------------------------

def make_step(query_lens: list[int], context_lens: list[int]) -> StepInputs:
    """A step whose sequence b feeds query_lens[b] tokens ending at context_lens[b] keys."""
    seqs = [Sequence(Request(i, (1,) * c, 1)) for i, c in enumerate(context_lens)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    positions = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
    return StepInputs(
        seqs=seqs, input_ids=torch.zeros(starts[-1], dtype=torch.long),
        positions=torch.tensor(positions), query_lens=list(query_lens), context_lens=list(context_lens),
        query_starts=starts, logits_indices=torch.zeros(0, dtype=torch.long),
        query_starts_t=torch.tensor(starts, dtype=torch.int32))


def reference_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_lens: list[int]) -> torch.Tensor:
    """torch SDPA per sequence, K/V heads repeated for their query-head groups, causal with the
    queries at the end of the context."""
    h = q.shape[1]
    out, start = [], 0
    for k, v, lq in zip(keys, values, query_lens):                    # k, v (ctx, H_kv, D)
        ctx = k.shape[0]
        g = h // k.shape[1]
        qb = q[start:start + lq].transpose(0, 1)                       # (H, Lq, D)
        kb = k.repeat_interleave(g, dim=1).transpose(0, 1)             # (H, ctx, D)
        vb = v.repeat_interleave(g, dim=1).transpose(0, 1)
        mask = torch.ones(lq, ctx, dtype=torch.bool).tril(diagonal=ctx - lq)
        out.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1))
        start += lq
    return torch.cat(out)                                             # (T, H, D)


ATTENTION = NaiveAttention(NaiveAttentionConfig(), None)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([5, 1, 3, 1], [5, 9, 7, 4]),     # a prefill, decodes, and a chunk after cached tokens
    ([1, 1, 1], [4, 9, 2]),           # decode only (the batched fast path)
], ids=["mixed", "decode"])
def test_naive_attention_matches_sdpa_on_a_ragged_batch(heads, query_lens, context_lens):
    h, h_kv = heads
    d, capacity = 16, 12
    gen = torch.Generator().manual_seed(0)
    step = make_step(query_lens, context_lens)
    q = torch.randn(sum(query_lens), h, d, generator=gen)
    # each row holds `capacity` slots; those past a sequence's context hold garbage that must not leak
    k = torch.randn(len(context_lens), capacity, h_kv, d, generator=gen) * 10
    v = torch.randn(len(context_lens), capacity, h_kv, d, generator=gen) * 10
    out = ATTENTION(q, PaddedKV(k, v), step)
    ref = reference_attention(q, [k[b, :c] for b, c in enumerate(context_lens)],
                              [v[b, :c] for b, c in enumerate(context_lens)], query_lens)
    assert out.shape == (sum(query_lens), h, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_naive_attention_on_packed_kv_is_causal_per_sequence():
    """The recompute cache hands attention this step's keys only, packed like the queries."""
    query_lens = [3, 7, 1]
    step = make_step(query_lens, query_lens)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(11, 4, 16, generator=gen)
    k = torch.randn(11, 2, 16, generator=gen)
    v = torch.randn(11, 2, 16, generator=gen)
    out = ATTENTION(q, PackedKV(k, v), step)
    ref = reference_attention(q, [k[:3], k[3:10], k[10:]], [v[:3], v[3:10], v[10:]], query_lens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the first query of each sequence sees only its own first key: its output is that value
    for start, n in ((0, 3), (3, 7), (10, 1)):
        torch.testing.assert_close(out[start], v[start].repeat_interleave(2, dim=0))


# -- RoPE ----------------------------------------------------------------------------------------------

def hidden_states(model: LlamaModel, tokens: list[int], offset: int = 0) -> torch.Tensor:
    """The final hidden states of one prompt placed at positions offset .. offset + n - 1."""
    n = len(tokens)
    step = make_step([n], [n])
    step.input_ids = torch.tensor(tokens)
    step.positions = torch.arange(offset, offset + n)
    engine = EngineConfig(max_num_seqs=1)
    cache = NoKVCache(NoKVCacheConfig(), BuildContext(model, KVSpec.of(model, engine, offset + n), engine))
    return model(Forward(step, cache, ATTENTION))


def test_rope_base_is_configurable_and_changes_the_output():
    tokens = [5, 17, 200, 3, 99, 42, 7, 128, 64, 11, 250, 1]
    low, high = (LlamaModel.random(preset("tiny", rope_base=b)) for b in (10_000.0, 1_000_000.0))
    assert torch.equal(low.embed.weight, high.embed.weight)     # same seed: only RoPE differs
    a, b = hidden_states(low, tokens), hidden_states(high, tokens)
    # at position 0 RoPE is the identity, and the first token sees only itself
    torch.testing.assert_close(a[0], b[0])
    assert (a[1:] - b[1:]).abs().max() > 1e-2
    # the tables hold cos(p base^(-2i/D)) for the D/2 rotating pairs
    d = 16
    for model, base in ((low, 10_000.0), (high, 1_000_000.0)):
        for p, i in ((5, 0), (7, 3), (300, 7)):
            angle = p * base ** (-2 * i / d)
            assert model.rope.cos[p, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert model.rope.sin[p, i].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_makes_attention_depend_on_relative_positions_only(tiny_model):
    """Shifting every position by the same amount leaves a RoPE model's outputs unchanged."""
    tokens = [9, 31, 250, 4, 77, 160, 2, 18]
    at_zero = hidden_states(tiny_model, tokens)
    shifted = hidden_states(tiny_model, tokens, offset=300)
    torch.testing.assert_close(at_zero, shifted, rtol=1e-4, atol=1e-4)
    # while another order of the same tokens is another output
    assert (hidden_states(tiny_model, tokens[::-1])[-1] - at_zero[-1]).abs().max() > 1e-2


def test_model_forward_through_the_runner_matches_a_direct_forward(build):
    """The runner's packed batch gives each sequence the logits of its own last token."""
    built = build({"kv_cache": "none"}, record=False)
    prompts = [(5, 17, 200), (3, 99, 42, 7, 128, 64, 11)]
    seqs = [Sequence(Request(i, p, 1)) for i, p in enumerate(prompts)]
    out = built.engine.runner.forward(Batch(seqs, [len(p) for p in prompts]))
    logits, rows = out.logits, out.rows
    assert rows == [1, 1] and logits.shape == (2, 256) and logits.dtype == torch.float32
    model = built.engine.runner.model
    for row, prompt in zip(logits, prompts):
        alone = model.logits(hidden_states(model, list(prompt))[-1:])[0]
        torch.testing.assert_close(row, alone, rtol=1e-4, atol=1e-4)


# -- config checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, named", [
    ({"n_layers": 0}, "n_layers"),
    ({"d_model": -64}, "d_model"),
    ({"n_heads": 0}, "n_heads"),
    ({"n_kv_heads": 0}, "n_kv_heads"),
    ({"n_kv_heads": 3}, "n_kv_heads"),          # 4 query heads cannot share 3 KV heads evenly
    ({"head_dim": -16}, "head_dim"),
    ({"head_dim": 15}, "head_dim"),             # RoPE rotates pairs of dimensions
    ({"d_ff": 0}, "d_ff"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"dtype": "fp8"}, "dtype"),
    ({"init": "zeros"}, "init"),
    ({"rope_base": 0.0}, "rope_base"),
    ({"rope_base": -10_000.0}, "rope_base"),
    ({"architecture": "mamba"}, "architecture"),
])
def test_bad_model_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"model\.{named}\b"):
        ModelConfig(**fields)


def test_unknown_model_field_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"model has no field n_layer; valid fields: name, n_layers"):
        build_dataclass(ModelConfig, {"n_layer": 3}, "model")
