"""MLA: the absorbed decode equals the explicit computation; SVD conversion; KV bytes from the cache."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ablate.api import BuildContext, EngineConfig, KVSpec
from ablate.api.plugin import Slot
from ablate.api.sequence import Request, Sequence
from ablate.api.step import Batch
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.measure.quality import sequence_logits
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.model.mla import MultiHeadLatentAttention, set_absorbed
from ablate_variants.mla import MLAConfig, to_mla

TOKENS = list(range(5, 60, 3))
PROMPTS = [(3, 1, 4, 1, 5), (9, 2, 6, 5, 3, 5, 8, 9, 7)]      # a ragged batch
DECODE_STEPS = 6


def decode_logits(model: LlamaModel, registry) -> list[torch.Tensor]:
    """Prefill a ragged batch into a contiguous cache, then greedy decode steps; every step's logits."""
    arm = resolve_arm("mla", {"kv_cache": "contiguous"}, baseline_configs(registry), registry)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=len(PROMPTS)), 32, registry)
    engine, cache = built.engine, built.kv_cache
    seqs = [Sequence(Request(i, p, max_new_tokens=DECODE_STEPS + 1)) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        seq.start()
    batch, out = Batch(seqs, [len(p) for p in PROMPTS]), []
    for _ in range(DECODE_STEPS + 1):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert cache.allocate(seq, n)
        batch = engine.checked(batch)
        logits = engine.runner.forward(batch).logits             # (B, V): one row per sequence
        out.append(logits)
        engine.commit(batch, {seq.seq_id: [int(row.argmax())] for seq, row in zip(seqs, logits)})
        batch = Batch(seqs, [1] * len(seqs))
    return out


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    return LlamaModel.random(preset("tiny", seed=2))


@pytest.mark.parametrize("source", ["mla-tiny preset", "tiny converted (rank 12, 4 of 8 pairs rotary)"])
def test_absorbed_decode_equals_explicit(source, tiny_model, ablate_registry, monkeypatch):
    if source.startswith("mla-tiny"):
        model = LlamaModel.random(preset("mla-tiny"))
    else:
        model, _ = to_mla(tiny_model, rank=12, rope_frequencies=4)
    absorbed_calls = []
    original = MultiHeadLatentAttention.absorbed
    monkeypatch.setattr(MultiHeadLatentAttention, "absorbed",
                        lambda self, *a: absorbed_calls.append(1) or original(self, *a))
    explicit = decode_logits(set_absorbed(model, False), ablate_registry)
    assert not absorbed_calls
    absorbed = decode_logits(set_absorbed(model, True), ablate_registry)
    assert len(absorbed_calls) == DECODE_STEPS * model.config.n_layers     # every decode step, every layer
    for e, a in zip(explicit, absorbed):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_full_rank_conversion_with_every_pair_rotary_is_the_source_model(tiny_model):
    converted, errors = to_mla(tiny_model)                      # rank = all of W_V, RoPE kept whole
    cfg = converted.config
    assert (cfg.attention_kind, cfg.kv_latent_dim, cfg.rope_head_dim) == ("mla", 32, 32)
    assert max(errors) < 1e-12
    torch.testing.assert_close(sequence_logits(converted, TOKENS), sequence_logits(tiny_model, TOKENS),
                               rtol=1e-4, atol=1e-4)
    assert converted.layers[0].mlp is tiny_model.layers[0].mlp and converted.embed is tiny_model.embed


def test_conversion_widths_and_refusals(tiny_model):
    converted, errors = to_mla(tiny_model, rank=8, rope_frequencies=2)
    assert (converted.config.kv_latent_dim, converted.config.rope_head_dim) == (8, 2 * 2 * 2)
    assert 0 < min(errors) and max(errors) < 1
    with pytest.raises(ValueError, match=r"rope_frequencies=9 exceeds the 8 frequency pairs"):
        to_mla(tiny_model, rope_frequencies=9)
    with pytest.raises(ValueError, match=r"rank=65 exceeds the rank of \[W_K\^NoPE; W_V\]"):
        to_mla(tiny_model, rank=65, rope_frequencies=1)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        MLAConfig(rank=-1)


def contiguous_cache(registry, spec: KVSpec, budget_bytes: int = 0):
    engine = EngineConfig(max_num_seqs=spec.max_num_seqs)
    ctx = BuildContext(None, spec, engine)                     # a cache reads the spec only
    config = registry.config(Slot.KV_CACHE, "contiguous", {"budget_bytes": budget_bytes})
    return registry.get(Slot.KV_CACHE, "contiguous")(config, ctx)


def cache_spec(cfg, max_num_seqs: int = 2, max_seq_len: int = 16) -> KVSpec:
    heads, k_width, v_width = cfg.kv_cache_widths
    return KVSpec(cfg.n_layers, heads, k_width, v_width, cfg.torch_dtype, torch.device("cpu"), max_num_seqs, max_seq_len)


def num_admitted(cache, tokens: int, limit: int) -> int:
    """Sequences of `tokens` tokens admitted one after another until the cache says no."""
    for i in range(limit):
        seq = Sequence(Request(i, (1,) * (tokens - 1), max_new_tokens=1))
        seq.start()
        if not cache.allocate(seq, tokens - 1):
            return i
    return limit


def test_kv_bytes_measured_from_the_cache_equal_the_formula_for_every_variant(tiny_model, ablate_registry):
    from ablate_variants.gqa import to_kv_heads
    models = {"gqa (as is)": tiny_model, "mqa": to_kv_heads(tiny_model, 1), "mha (repeated)": to_kv_heads(tiny_model, 4),
              "mla (svd)": to_mla(tiny_model, rank=8, rope_frequencies=2)[0],
              "mla-tiny": LlamaModel.random(preset("mla-tiny", dtype="bf16"))}
    # layers x (K + V widths of every cached head) x dtype bytes
    expected = {"gqa (as is)": 2 * 2 * 2 * 16 * 4, "mqa": 2 * 2 * 1 * 16 * 4, "mha (repeated)": 2 * 2 * 4 * 16 * 4,
                "mla (svd)": 2 * (8 + 8) * 4, "mla-tiny": 2 * (16 + 16) * 2}
    for name, model in models.items():
        spec = KVSpec.of(model, EngineConfig(max_num_seqs=3), 16)
        cache = contiguous_cache(ablate_registry, spec)
        measured = cache.bytes_reserved() / (cache.num_slots * cache.capacity)    # the buffers' bytes per token slot
        assert measured == spec.bytes_per_token == model.config.kv_bytes_per_token() == expected[name], name


def test_mla_preset_stores_at_most_a_quarter_of_mha_and_the_budget_admits_more(ablate_registry):
    mla = preset("mla-small", dtype="bf16")           # 128-dim heads, latent 512 + rotary key 64
    mha = replace(mla, attention_kind="mha", kv_latent_dim=0, rope_head_dim=0)
    budget = 64 * 8 * mha.kv_bytes_per_token()         # room for 64 MHA sequences of 8 tokens
    measured, admitted = {}, {}
    for name, cfg in {"mla": mla, "mha": mha}.items():
        cache = contiguous_cache(ablate_registry, cache_spec(cfg, max_num_seqs=1, max_seq_len=8))
        measured[name] = cache.bytes_reserved() / (cache.num_slots * cache.capacity)
        cache = contiguous_cache(ablate_registry, cache_spec(cfg, max_num_seqs=10_000, max_seq_len=8), budget)
        admitted[name] = num_admitted(cache, 8, 10_000)
    assert measured["mla"] == 4 * (512 + 64) * 2 and measured["mha"] == 4 * 2 * 16 * 128 * 2
    assert measured["mla"] / measured["mha"] <= 1 / 4
    assert admitted["mha"] == 64 and admitted["mla"] == 64 * 4096 // 576     # 455: 7.1x as many


@pytest.mark.parametrize("kv_cache", ["contiguous", "dynamic", "paged"])
def test_mla_gives_the_same_tokens_through_every_cache(kv_cache, ablate_registry):
    """The cached rows [c, k^R] (zero-width V) through each cache's layout, absorbed at decode."""
    model = LlamaModel.random(preset("mla-tiny"))
    requests = [Request(i, p, 6) for i, p in enumerate(PROMPTS)]
    outputs = []
    for spec in ({}, {"kv_cache": kv_cache}, {"kv_cache": kv_cache, "attention": "sdpa"}):
        arm = resolve_arm("mla", spec, baseline_configs(ablate_registry), ablate_registry)
        built = build_arm(arm, model, EngineConfig(max_num_seqs=2), 16, ablate_registry)
        outputs.append([s.output_token_ids for s in built.engine.run(requests)])
        built.close()
    assert outputs[0] == outputs[1] == outputs[2]


# the same kit call as tests/test_conformance.py::test_plugin_conforms[variant=mla], in the default run
@pytest.mark.slow
def test_mla_plugin_conforms(ablate_check_plugin):
    ablate_check_plugin("variant", "mla")


def test_activation_aware_factorisation_fits_the_calibration_inputs_better():
    from ablate_variants.mla import low_rank
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(12, 16, generator=gen, dtype=torch.float64)
    scales = torch.logspace(0, 2, 16, dtype=torch.float64)                  # a few channels dominate the inputs
    x = torch.randn(400, 16, generator=gen, dtype=torch.float64) * scales  # (N, d)
    plain_up, plain_down, _ = low_rank(m, 4, None)
    aware_up, aware_down, aware_error = low_rank(m, 4, x.T @ x)
    output_error = {name: ((m - up @ down) @ x.T).norm() / (m @ x.T).norm()
                    for name, (up, down) in {"plain": (plain_up, plain_down), "aware": (aware_up, aware_down)}.items()}
    assert output_error["aware"] < 0.5 * output_error["plain"]
    assert aware_error == pytest.approx(float(output_error["aware"]), rel=1e-4)
    full_up, full_down, full_error = low_rank(m, 12, x.T @ x)
    assert full_error < 1e-12 and torch.allclose(full_up @ full_down, m, atol=1e-8)


def test_calibrated_plugin_converts_with_corpus_free_tokens_on_a_random_model(tiny_model, ablate_registry):
    from ablate_variants.mla import LatentKV
    plugin = LatentKV(MLAConfig(rank=16, rope_frequencies=4, calibration_tokens=64), None)
    converted = plugin.apply(tiny_model)
    assert converted.config.kv_latent_dim == 16 and 0 < plugin.stats()["svd_relative_error"] < 1
