"""Greedy speculative decoding emits exactly the target's greedy tokens: every drafter, every KV
cache plugin, batches of 1 and 4 sequences of different lengths finishing at different steps."""
from __future__ import annotations

import pytest

from ablate.api.plugin import Slot
from ablate.engine.registry import default_registry

PROMPT_LENS = [3, 11, 17, 30]
MAX_NEW = [9, 4, 13, 6]         # each sequence finishes at a different step; k is cut near the end

DRAFTERS = {
    "draft_model-poor": {"drafter": "draft_model", "draft_model": "tiny",
                         "draft_overrides": {"seed": 1}},                # another random model: rejections
    "draft_model-same": {"drafter": "draft_model", "draft_model": "tiny",
                         "draft_overrides": {"n_layers": 4}},            # the target itself: all accepted
    "ngram": {"drafter": "ngram", "ngram_n": 2},
    "early_exit": {"drafter": "early_exit", "exit_layer": 2},
    "layer_skip": {"drafter": "layer_skip", "skip_every": 2},
}


def speculative(drafter: str, k: int = 3) -> dict:
    return {"name": "speculative", "k": k, **DRAFTERS[drafter]}


@pytest.fixture(scope="module")
def reference(build, target, make_requests) -> list[list[int]]:
    """The target's greedy tokens: autoregressive decoding, recomputing every step (no cache)."""
    seqs = build({"kv_cache": "none"}, target).engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    return [s.output_token_ids for s in seqs]


def crossed(drafters, kv_caches, batch_sizes, fast):
    """Every (drafter, kv_cache, batch_size); those `fast` does not pick are marked slow (CI runs them)."""
    return [pytest.param(d, kv, b, marks=[] if fast(d, kv, b) else pytest.mark.slow)
            for d in drafters for kv in kv_caches for b in batch_sizes]


# every drafter with every cache at a batch of 4 in the default run; a batch of 1 there with the contiguous cache
@pytest.mark.parametrize("drafter, kv_cache, batch_size", crossed(
    list(DRAFTERS), default_registry().choices(Slot.KV_CACHE), [1, 4], lambda d, kv, b: b == 4 or kv == "contiguous"))
def test_greedy_tokens_equal_autoregressive(drafter, kv_cache, batch_size, build, target, make_requests, reference):
    built = build({"kv_cache": kv_cache, "decoding": speculative(drafter)}, target, max_num_seqs=batch_size)
    seqs = built.engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    assert [s.output_token_ids for s in seqs] == reference
    stats = built.plugins[Slot.DECODING].stats()
    assert stats["proposed_tokens"] > 0                        # drafts were made and verified
    if drafter == "draft_model-same":
        assert stats["accepted_tokens"] == stats["proposed_tokens"]
    else:
        assert 0 <= stats["accepted_tokens"] < stats["proposed_tokens"]   # rejections were rolled back
    assert built.kv_cache.bytes_used() == 0                    # every sequence released its room
    built.close()


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_stop_token_inside_accepted_drafts(kv_cache, build, target, make_requests, reference):
    """A stop token among accepted drafts ends the sequence there, with the caches consistent."""
    stop = reference[2][5]                                     # request 2's 6th greedy token
    expected = reference[2][:reference[2].index(stop) + 1]
    requests = make_requests(PROMPT_LENS, MAX_NEW, stop_token_ids=(stop,))
    built = build({"kv_cache": kv_cache, "decoding": speculative("draft_model-same", k=4)}, target)
    seqs = built.engine.run(requests)
    assert seqs[2].output_token_ids == expected
    assert seqs[2].finish_reason == "stop"
    for seq in seqs:
        assert seq.num_computed_tokens == seq.num_tokens - 1   # the last token is pending, nothing beyond
    auto = build({"kv_cache": kv_cache}, target).engine.run(requests)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in auto]
    built.close()


def test_k_larger_than_the_output(build, target, make_requests, reference):
    """k = 16 drafts, never more than max_new_tokens - 1 per step: lengths are exact."""
    built = build({"kv_cache": "contiguous", "decoding": speculative("draft_model-same", k=16)}, target)
    seqs = built.engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    assert [s.output_token_ids for s in seqs] == reference
    stats = built.plugins[Slot.DECODING].stats()
    # one prefill step, then each sequence's remaining tokens in one verification
    assert stats["verifications"] == len(PROMPT_LENS)
    assert stats["tokens_per_target_forward"] == pytest.approx(sum(m - 1 for m in MAX_NEW) / len(MAX_NEW))


# 4 layers x 2 KV heads x 16 dims x K and V x 4 bytes per token: 11 blocks of 4 tokens hold two of
# these requests' prompts, and not their growth
TIGHT_PAGED = {"name": "paged", "block_size": 4, "budget_bytes": 11 * 4 * 1024}
SCHEDULES = {
    "continuous": ({"kv_cache": "contiguous", "scheduler": "continuous"}, {"max_num_seqs": 2}),
    "preempting": ({"kv_cache": TIGHT_PAGED, "scheduler": "continuous"}, {}),
    "preempting-chunked": ({"kv_cache": TIGHT_PAGED, "scheduler": {"name": "continuous", "chunked_prefill": True,
                                                                   "prefill_chunk": 8}},
                           {"max_num_batched_tokens": 9}),
}
LONG_PROMPTS, LONG_NEW = [9, 13, 17, 21], [20, 16, 20, 12]


@pytest.fixture(scope="module")
def long_reference(build, target, make_requests) -> list[list[int]]:
    seqs = build({"kv_cache": "none"}, target).engine.run(make_requests(LONG_PROMPTS, LONG_NEW))
    return [s.output_token_ids for s in seqs]


# one drafter per schedule in the default run (each drafter once), the rest slow
FAST_SCHEDULED = {("continuous", "ngram"), ("preempting", "early_exit"), ("preempting-chunked", "draft_model-poor")}


@pytest.mark.parametrize("schedule, drafter", [
    pytest.param(s, d, marks=[] if (s, d) in FAST_SCHEDULED else pytest.mark.slow)
    for s in SCHEDULES for d in ["draft_model-poor", "ngram", "early_exit"]])
def test_greedy_with_continuous_batching(schedule, drafter, build, target, make_requests, long_reference):
    """Sequences join and leave every step, are preempted and recomputed (in chunks): the tokens
    stay the target's, and the draft's cache follows (a preempted sequence's draft room is freed)."""
    spec, engine = SCHEDULES[schedule]
    built = build({**spec, "decoding": speculative(drafter)}, target, max_seq_len=44, **engine)
    seqs = built.engine.run(make_requests(LONG_PROMPTS, LONG_NEW))
    assert [s.output_token_ids for s in seqs] == long_reference
    if schedule.startswith("preempting"):
        assert sum(s.num_preemptions for s in seqs) > 0
    assert built.plugins[Slot.DECODING].stats()["proposed_tokens"] > 0
    built.close()
