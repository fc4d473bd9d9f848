"""kv_cache=streaming: exact while sequences fit, bounded memory past the window, the right tokens
kept (sinks + newest), rollback, and the generic slots around it (continuous scheduler, sdpa)."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from ablate.api import Batch, BuildContext, EngineConfig, KVCache, KVSpec, PluginError, Request, Slot, StepInputs
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.runner import ModelRunner
from ablate.engine.session import Shadow
from ablate.measure.recorder import Recorder
from ablate_streaming.cache import StreamingConfig, StreamingKVCache

SINKS, WINDOW = 4, 16
LIMIT = SINKS + WINDOW
SMALL = {"name": "streaming", "num_sinks": SINKS, "window": WINDOW}


def build(registry, model, spec: dict[str, Any], max_num_seqs: int = 4, max_seq_len: int = 160,
          hooks_for=lambda kv_cache: ()) -> BuiltArm:
    arm = resolve_arm("test", spec, baseline_configs(registry), registry)
    return build_arm(arm, model, EngineConfig(max_num_seqs=max_num_seqs), max_seq_len, registry, hooks_for)


def requests(lengths: list[tuple[int, int]], seed: int = 0) -> list[Request]:
    """One request per (prompt, output) length, random prompts."""
    rng = random.Random(seed)
    return [Request(i, tuple(rng.randrange(256) for _ in range(p)), n) for i, (p, n) in enumerate(lengths)]


def outputs(built: BuiltArm, reqs: list[Request]) -> list[list[int]]:
    return [s.output_token_ids for s in built.engine.run(reqs)]


# the same kit call as tests/test_conformance.py::test_plugin_conforms[kv_cache=streaming], in the default run
@pytest.mark.slow
def test_conforms(ablate_check_plugin):
    ablate_check_plugin("kv_cache", "streaming")


# -- exact while nothing is evicted ---------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_baseline_tokens_while_sequences_fit(ablate_registry, ablate_tiny_model, scheduler):
    """A sequence of up to LIMIT + 1 tokens feeds at most LIMIT (its last is never fed): no eviction."""
    reqs = requests([(3, 9), (12, LIMIT + 1 - 12), (LIMIT, 1), (7, 4)])
    want = outputs(build(ablate_registry, ablate_tiny_model, {}), reqs)
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": SMALL, "scheduler": scheduler}, max_num_seqs=2)
    assert outputs(built, reqs) == want
    assert built.kv_cache.stats()["tokens_evicted"] == 0


# -- bounded memory --------------------------------------------------------------------------------
def test_memory_is_bounded_past_the_window(ablate_registry, ablate_tiny_model):
    prompt, new = 8, 120
    recorders: list[Recorder] = []
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": SMALL}, max_num_seqs=1,
                  hooks_for=lambda kv_cache: recorders.append(Recorder(kv_cache)) or recorders)
    seq, = built.engine.run(requests([(prompt, new)]))
    assert seq.num_output_tokens == new
    token_bytes = built.kv_cache.spec.bytes_per_token
    stats = built.kv_cache.stats()
    # every decode step evicts down to LIMIT and adds one; the last token is never fed
    assert stats["tokens_evicted"] == (prompt + new - 1) - (LIMIT + 1)
    assert stats["peak_tokens_held"] == LIMIT + 1
    assert stats["kv_capacity_tokens"] == LIMIT + 1
    assert stats["kv_peak_reserved_bytes"] == (LIMIT + 1) * token_bytes
    assert max(step.kv_bytes_used for step in recorders[0].steps) == (LIMIT + 1) * token_bytes
    dynamic = build(ablate_registry, ablate_tiny_model, {"kv_cache": "dynamic"}, max_num_seqs=1)
    dynamic.engine.run(requests([(prompt, new)]))
    assert dynamic.kv_cache.stats()["kv_peak_reserved_bytes"] >= (prompt + new - 1) * token_bytes   # grows with length


# -- which tokens stay -----------------------------------------------------------------------------
def make_cache(model, cls: type[KVCache], config, max_seq_len: int = 200) -> KVCache:
    engine = EngineConfig(max_num_seqs=2)
    return cls(config, BuildContext(model, KVSpec.of(model, engine, max_seq_len), engine))


def feed(runner: ModelRunner, seq: Shadow, chunks: list[int]) -> None:
    """Run `seq`'s next tokens through the runner, chunks[i] of them in step i (as the engine would:
    allocate, forward, commit)."""
    for n in chunks:
        assert runner.kv_cache.allocate(seq, n)
        runner.forward(Batch([seq], [n]))
        seq.sync(seq.token_ids, seq.num_computed_tokens + n)
        runner.kv_cache.commit(seq, seq.num_computed_tokens)


def roll_back(cache: KVCache, seq: Shadow, num_tokens: int) -> None:
    """Keep only the first `num_tokens` (a model session rolling back a rejected draft)."""
    seq.sync(seq.token_ids[:num_tokens], num_tokens)
    cache.commit(seq, num_tokens)


def held_kv(cache: KVCache, seq: Shadow, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V (held, H_kv, D) the cache holds for `seq` now, read through its own view with a
    step that feeds nothing (the view's kv_lens say how many)."""
    empty = torch.empty(0, dtype=torch.long)
    n = seq.num_computed_tokens
    step = StepInputs(seqs=[seq], input_ids=empty, positions=empty, query_lens=[0], context_lens=[n],
                      query_starts=[0, 0], logits_indices=empty, query_starts_t=torch.tensor([0, 0]))
    step = cache.begin_step(step)
    k, v = cache.view(layer, step).padded(step)                 # (1, held, H_kv, D)
    return k[0].clone(), v[0].clone()


def layer0_kv(model, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V (N, H_kv, D) of every position: they depend on the token and its position
    only (RoPE after the projection), not on what attention saw, so any cache must hold these."""
    from ablate_kv_cache.dynamic import DynamicConfig, DynamicKVCache
    cache = make_cache(model, DynamicKVCache, DynamicConfig())
    seq = Shadow(Request(0, tuple(token_ids), 1))
    runner = ModelRunner(model, cache, build_attention(model, cache))
    feed(runner, seq, [len(token_ids)])
    return held_kv(cache, seq)


def build_attention(model, cache: KVCache):
    from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
    return NaiveAttention(NaiveAttentionConfig(), BuildContext(model, cache.spec, EngineConfig()))


def expected_positions(length: int, sinks: int, window: int) -> list[int]:
    return list(range(min(sinks, length))) + list(range(max(sinks, length - window), length))


def streaming_runner(model, sinks: int, window: int) -> tuple[ModelRunner, StreamingKVCache]:
    cache = make_cache(model, StreamingKVCache, StreamingConfig(num_sinks=sinks, window=window))
    return ModelRunner(model, cache, build_attention(model, cache)), cache


@pytest.mark.parametrize("chunks", [[1] * 40, [30, 1, 1, 1, 1, 1], [5] * 8, [3, 17, 2, 9, 1, 8]],
                         ids=["one-per-step", "long-prompt", "chunks-of-5", "ragged"])
def test_eviction_keeps_the_sinks_and_the_newest_tokens(ablate_tiny_model, chunks):
    sinks, window = 2, 6
    runner, cache = streaming_runner(ablate_tiny_model, sinks, window)
    token_ids = [random.Random(1).randrange(256) for _ in range(sum(chunks))]
    seq = Shadow(Request(0, tuple(token_ids), 1))
    feed(runner, seq, chunks)
    k, v = held_kv(cache, seq)
    k_all, v_all = layer0_kv(ablate_tiny_model, token_ids)
    kept = expected_positions(len(token_ids), sinks, window)
    torch.testing.assert_close(k, k_all[kept])
    torch.testing.assert_close(v, v_all[kept])
    assert cache.bytes_used() == len(kept) * cache.spec.bytes_per_token
    assert cache.stats()["tokens_evicted"] == len(token_ids) - len(kept)


def test_rollback_drops_the_newest_and_refills(ablate_tiny_model):
    """A rollback after a verification step: as if the rejected tokens never came; rolling back
    past the window leaves the sinks, and the window refills from there."""
    sinks, window = 2, 6
    runner, cache = streaming_runner(ablate_tiny_model, sinks, window)
    rng = random.Random(2)
    seq = Shadow(Request(0, tuple(rng.randrange(256) for _ in range(20)), 1))
    feed(runner, seq, [1] * 20)                                  # evicting every step by now
    seq.sync(seq.token_ids + [rng.randrange(256) for _ in range(4)], 20)   # a pending token and three drafts
    feed(runner, seq, [4])
    roll_back(cache, seq, seq.num_tokens - 2)                    # two drafts rejected
    assert cache.bytes_used() == (sinks + window + 2) * cache.spec.bytes_per_token
    seq.sync(seq.token_ids + [rng.randrange(256)], seq.num_computed_tokens)
    feed(runner, seq, [1])
    k, _ = held_kv(cache, seq)
    k_all, _ = layer0_kv(ablate_tiny_model, seq.token_ids)
    torch.testing.assert_close(k, k_all[expected_positions(seq.num_tokens, sinks, window)])

    roll_back(cache, seq, 5)                                     # before the oldest recent token held
    assert cache.bytes_used() == sinks * cache.spec.bytes_per_token
    seq.sync(seq.token_ids + [rng.randrange(256) for _ in range(3)], 5)
    feed(runner, seq, [1, 1, 1])
    k, _ = held_kv(cache, seq)
    k_all, _ = layer0_kv(ablate_tiny_model, seq.token_ids)
    torch.testing.assert_close(k, k_all[[0, 1, 5, 6, 7]])     # sinks, then what came after the rollback
    with pytest.raises(PluginError, match="9 tokens committed"):
        cache.commit(seq, 9)                                     # it holds room for 8


# -- with the other slots --------------------------------------------------------------------------
RAGGED = [(5, 40), (30, 12), (9, 33), (17, 25), (2, 6)]


def test_continuous_scheduler_and_sdpa_give_the_same_tokens(ablate_registry, ablate_tiny_model):
    """Each row is its own: joining, leaving, slots that are not consecutive and the attention
    implementation change nothing once the prompt goes in whole."""
    reqs = requests(RAGGED, seed=3)
    small = {"name": "streaming", "num_sinks": 2, "window": 8}
    plain = build(ablate_registry, ablate_tiny_model, {"kv_cache": small}, max_num_seqs=2)
    want = outputs(plain, reqs)
    assert plain.kv_cache.stats()["tokens_evicted"] > 0
    for spec in ({"scheduler": "continuous"}, {"attention": "sdpa"},
                 {"scheduler": "continuous", "attention": "sdpa"}):
        built = build(ablate_registry, ablate_tiny_model, {"kv_cache": small, **spec}, max_num_seqs=2)
        assert outputs(built, reqs) == want, spec


@pytest.mark.parametrize("drafter", [{"drafter": "ngram", "ngram_n": 1},
                                     {"drafter": "draft_model", "draft_model": "tiny", "draft_overrides": {"seed": 1}}],
                         ids=["ngram", "draft_model"])
def test_speculative_decoding_rolls_back_while_evicting(ablate_registry, ablate_tiny_model, drafter):
    """Rejected drafts are truncated from the target's cache (and from the draft model's own
    streaming cache) while both evict: every sequence finishes, holding no more than the window."""
    small = {"name": "streaming", "num_sinks": 2, "window": 8}
    k = 3
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": small, "decoding": {"name": "speculative", "k": k, **drafter}})
    seqs = built.engine.run(requests(RAGGED, seed=4))
    assert all(s.num_output_tokens == s.request.max_new_tokens for s in seqs)
    stats = built.stats()
    assert stats["decoding.proposed_tokens"] > stats["decoding.accepted_tokens"]       # rejections happened
    assert stats["kv_cache.tokens_evicted"] > 0
    assert stats["kv_cache.peak_tokens_held"] <= max(p for p, _ in RAGGED) + k + 1
    assert built.kv_cache.bytes_used() == 0                                          # all released
    built.close()


def test_chunked_prefill_keeps_rows_narrow(ablate_registry, ablate_tiny_model):
    chunk = 4
    spec = {"kv_cache": SMALL, "scheduler": {"name": "continuous", "chunked_prefill": True, "prefill_chunk": chunk}}
    built = build(ablate_registry, ablate_tiny_model, spec, max_num_seqs=2)
    seqs = built.engine.run(requests([(60, 10), (45, 20)]))
    assert all(s.num_output_tokens == s.request.max_new_tokens for s in seqs)
    assert built.kv_cache.stats()["kv_capacity_tokens"] <= LIMIT + chunk


def test_budget_limits_the_rows(ablate_registry, ablate_tiny_model):
    """Rows for two sequences, as wide as the longest prompt: two run at once, the rest wait."""
    token_bytes = KVSpec.of(ablate_tiny_model, EngineConfig(), 1).bytes_per_token
    longest = max(p for p, _ in RAGGED)
    two_rows = {**SMALL, "budget_bytes": 2 * longest * token_bytes}
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": two_rows, "scheduler": "continuous"})
    seqs = built.engine.run(requests(RAGGED))
    assert all(s.is_finished for s in seqs)
    assert built.kv_cache.stats()["max_seqs_admitted"] == 2
    assert built.kv_cache.stats()["kv_peak_reserved_bytes"] <= two_rows["budget_bytes"]
    with pytest.raises(ValueError, match=f"holds no row of {LIMIT + 1} tokens"):
        build(ablate_registry, ablate_tiny_model, {"kv_cache": {**SMALL, "budget_bytes": token_bytes}})


def test_config_is_validated():
    with pytest.raises(ValueError, match="window must be >= 1"):
        StreamingConfig(window=0)
    with pytest.raises(ValueError, match="num_sinks must be >= 0"):
        StreamingConfig(num_sinks=-1)


def test_declares_what_it_is():
    assert StreamingKVCache.slot is Slot.KV_CACHE and not StreamingKVCache.exact
    assert StreamingKVCache.quality is not None
