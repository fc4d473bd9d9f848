"""kv_cache=paged on the tiny random model: exact greedy tokens, rollback, budgets, prefix sharing."""
from __future__ import annotations

import random

import pytest

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, Sequence
from ablate.api.step import Batch
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.measure.recorder import Recorder

PROMPT_LENS = [3, 11, 17, 30]
MAX_NEW = [9, 4, 13, 6]        # every sequence finishes at a different step
MAX_SEQ_LEN = 40


def build(registry, model, spec, *, max_num_seqs: int = 8, max_seq_len: int = MAX_SEQ_LEN,
          max_num_batched_tokens: int = 4096, record: bool = True) -> BuiltArm:
    arm = resolve_arm("test", spec, baseline_configs(registry), registry)
    recorders: list[Recorder] = []

    def hooks(kv_cache):
        if record:
            recorders.append(Recorder(kv_cache))
        return recorders

    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    built = build_arm(arm, model, engine, max_seq_len, registry, hooks)
    built.recorder = recorders[0] if record else None
    return built


def requests(prompt_lens, max_new, seed: int = 0, prefix: tuple[int, ...] = ()) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, prefix + tuple(rng.randrange(256) for _ in range(p)), n)
            for i, (p, n) in enumerate(zip(prompt_lens, max_new))]


def outputs(seqs: list[Sequence]) -> list[list[int]]:
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def recompute_tokens(ablate_registry, ablate_tiny_model) -> list[list[int]]:
    """The baseline: no cache, every step recomputes the whole prefix."""
    return outputs(build(ablate_registry, ablate_tiny_model, {}).engine.run(requests(PROMPT_LENS, MAX_NEW)))


@pytest.mark.parametrize("spec", [
    {"kv_cache": "paged"},
    {"kv_cache": {"name": "paged", "block_size": 1}},
    {"kv_cache": {"name": "paged", "block_size": 4}, "attention": "sdpa"},
    {"kv_cache": {"name": "paged", "block_size": 4}, "attention": {"name": "paged", "backend": "torch"}},
    {"kv_cache": {"name": "paged", "block_size": 4, "prefix_caching": True}},
], ids=["bs16-naive", "bs1", "bs4-sdpa", "bs4-paged-attention", "bs4-prefix-caching"])
def test_greedy_tokens_equal_recompute_on_a_ragged_batch(spec, ablate_registry, ablate_tiny_model, recompute_tokens):
    built = build(ablate_registry, ablate_tiny_model, spec)
    seqs = built.engine.run(requests(PROMPT_LENS, MAX_NEW))
    assert outputs(seqs) == recompute_tokens
    cache = built.kv_cache
    assert cache.manager.num_free_blocks == cache.manager.num_blocks      # everything released
    steps = built.recorder.steps
    # reserved = blocks held x block bytes: after the prefill step, ceil(prompt / bs) blocks each
    bs = cache.block_size
    assert steps[0].kv_bytes_reserved == sum(-(-p // bs) for p in PROMPT_LENS) * cache.block_bytes
    assert steps[0].kv_bytes_used == sum(PROMPT_LENS) * cache.spec.bytes_per_token
    assert cache.stats()["kv_pool_bytes"] == cache.manager.num_blocks * cache.block_bytes
    built.close()


def test_rejected_drafts_give_their_blocks_back_and_decoding_continues_exactly(ablate_registry, ablate_tiny_model):
    request = requests([10], [14])[0]
    reference = build(ablate_registry, ablate_tiny_model, {"kv_cache": {"name": "paged", "block_size": 4}}
                      ).engine.run([request])[0].output_token_ids
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": {"name": "paged", "block_size": 4}}, record=False)
    engine, cache = built.engine, built.kv_cache
    seq = Sequence(request)
    engine.scheduler.add(seq)
    while seq.num_output_tokens < 8:
        engine.step(engine.scheduler.next_batch())
    assert seq.num_computed_tokens == 17                        # 10 + 7: the 8th output token is pending
    # the pending token and 5 drafts across a block boundary, all rejected, as speculative decoding would
    drafts = [1, 2, 3, 4, 5]
    assert cache.allocate(seq, 1, num_lookahead_tokens=len(drafts))
    assert cache.manager.num_used_blocks == -(-(17 + 1 + 5) // 4)
    batch = engine.checked(Batch([seq], [1]))
    out = engine.runner.forward(batch, {seq.seq_id: drafts})
    engine.commit(batch, {seq.seq_id: [int(out.logits[0].argmax())]})
    assert cache.manager.num_used_blocks == -(-18 // 4)         # the drafts' blocks are free again
    assert cache.bytes_used() == 18 * cache.bytes_per_token
    assert cache.bytes_reserved() == -(-18 // 4) * cache.block_bytes
    while not seq.is_finished:
        engine.step(engine.scheduler.next_batch())
    assert seq.output_token_ids == reference


def test_paged_admits_more_sequences_than_contiguous_under_the_same_budget(ablate_registry, ablate_tiny_model):
    # the budget holds 2 sequences of the maximum length (64); the requests are ~14 tokens long
    bytes_per_token = 2 * 2 * 2 * 16 * 4          # K and V x layers x kv heads x head dim x fp32
    budget = 2 * 64 * bytes_per_token
    work = requests([8] * 8, [6] * 8, seed=3)
    runs = {}
    for name in ("contiguous", "paged"):
        built = build(ablate_registry, ablate_tiny_model,
                      {"kv_cache": {"name": name, "budget_bytes": budget}, "scheduler": "continuous"}, max_seq_len=64)
        assert built.kv_cache.spec.bytes_per_token == bytes_per_token
        runs[name] = (outputs(built.engine.run(work)), built)
    (contiguous_out, contiguous), (paged_out, paged) = runs["contiguous"], runs["paged"]
    assert contiguous_out == paged_out
    held = {name: max(s.num_seqs_admitted for s in built.recorder.steps) for name, (_, built) in runs.items()}
    assert held["contiguous"] == 2 == contiguous.kv_cache.stats()["max_seqs_admitted"]
    assert held["paged"] == 8 == paged.kv_cache.stats()["max_seqs_admitted"]    # 8 x 4 blocks of 4 <= 128 slots
    # and what each holds is mostly used: contiguous reserves 64 tokens for ~14
    util = {name: max(s.kv_bytes_used / s.kv_bytes_reserved for s in built.recorder.steps)
            for name, (_, built) in runs.items()}
    assert util["contiguous"] < 0.25 and util["paged"] > 0.8


def test_the_budget_can_be_a_fraction_of_free_memory(ablate_registry, ablate_tiny_model, monkeypatch):
    import ablate.api.kv as kv

    monkeypatch.setattr(kv, "free_memory_bytes", lambda device: 10_000_000)
    paged = build(ablate_registry, ablate_tiny_model, {"kv_cache": {"name": "paged", "budget_fraction": 0.01}})
    assert paged.kv_cache.manager.num_blocks == 100_000 // paged.kv_cache.block_bytes      # 1% of 10 MB
    contiguous = build(ablate_registry, ablate_tiny_model,
                       {"kv_cache": {"name": "contiguous", "budget_fraction": 0.01}})
    assert contiguous.kv_cache.num_slots == 100_000 // (MAX_SEQ_LEN * 512) == 4
    with pytest.raises(ValueError, match="fewer than one sequence of 40 tokens"):
        build(ablate_registry, ablate_tiny_model, {"kv_cache": {"name": "paged", "budget_fraction": 0.0001}})
    with pytest.raises(ValueError, match="budget_bytes and kv_cache.budget_fraction are both set"):
        build(ablate_registry, ablate_tiny_model, {"kv_cache": {"name": "paged", "budget_fraction": 0.5,
                                                                "budget_bytes": 10}})


def test_prefix_caching_reuses_a_shared_prompt_prefix(ablate_registry, ablate_tiny_model):
    shared = tuple(range(100, 120))                              # 20 tokens: 5 full blocks of 4
    work = requests([3, 5, 2], [6, 4, 5], seed=5, prefix=shared)
    spec = {"kv_cache": {"name": "paged", "block_size": 4, "prefix_caching": True}, "scheduler": "continuous"}
    alone = [outputs(build(ablate_registry, ablate_tiny_model, {}).engine.run([r]))[0] for r in work]
    # one at a time: each later request finds the first one's prefix blocks (freed, still cached)
    built = build(ablate_registry, ablate_tiny_model, spec, max_num_seqs=1)
    assert outputs(built.engine.run(work)) == alone
    stats = built.kv_cache.stats()
    assert stats["prefix_cache_hit_blocks"] == 2 * 5
    # the later requests fed only what the cache did not hold: prefill steps of 3 + 5, then 5 + ... tokens
    prefill_steps = [s.num_tokens for s in built.recorder.steps if s.num_prefill_seqs]
    assert prefill_steps == [23, 25 - 20, 22 - 20]
