"""After a rejection, the target's and the draft's caches hold what a run that never saw the rejected
tokens holds: the same K/V over the valid region (read back through the cache's own view) and the
same bookkeeping (computed tokens, bytes used, blocks held)."""
from __future__ import annotations

import pytest
import torch

from ablate.api import Batch, BuildContext, EngineConfig, KVCache, Request, Sequence, Slot, StepInputs
from ablate.engine.registry import default_registry
from ablate.engine.runner import ModelRunner
from ablate.engine.session import Shadow
from ablate.model.llama import LlamaModel
from ablate_decoding.drafter import Drafter

PROMPT_LEN, MAX_NEW, K = 11, 12, 4
KEEPING_CACHES = [c for c in default_registry().choices(Slot.KV_CACHE) if default_registry().get(Slot.KV_CACHE, c).keeps_kv]


class ScriptedDrafter(Drafter):
    """Proposes the target's true greedy continuation for `num_good` tokens, then wrong ones."""

    def __init__(self, reference: list[int], num_good: int, vocab_size: int) -> None:
        self.reference, self.num_good, self.vocab_size = reference, num_good, vocab_size

    def propose(self, seqs, num_drafts):
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            true = self.reference[seq.num_output_tokens:seq.num_output_tokens + k]
            drafts.append(true[:self.num_good] + [(t + 1) % self.vocab_size for t in true[self.num_good:]])
        return drafts, [None] * len(seqs)


def cached_kv(cache: KVCache, seq: Sequence, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K and V (num_tokens, H_kv, D) the cache holds for seq, read through its view
    with a step that feeds nothing new."""
    empty = torch.empty(0, dtype=torch.long)
    step = StepInputs(seqs=[seq], input_ids=empty, positions=empty, query_lens=[0], context_lens=[num_tokens],
                      query_starts=[0, 0], logits_indices=empty, query_starts_t=torch.tensor([0, 0]))
    step = cache.begin_step(step)
    out = []
    for layer in range(cache.spec.num_layers):
        k, v = cache.view(layer, step).padded(step)          # (1, S, H_kv, D)
        out.append((k[0, :num_tokens].clone(), v[0, :num_tokens].clone()))
    return out


def fresh_kv(model: LlamaModel, like: KVCache, attention, token_ids: list[int]):
    """The K/V a cache of the same plugin holds after one prefill of exactly `token_ids`."""
    cache = type(like)(like.config, BuildContext(model, like.spec, EngineConfig()))
    seq = Shadow(Request(10_000, tuple(token_ids), 1))
    assert cache.allocate(seq, len(token_ids))
    ModelRunner(model, cache, attention).forward(Batch([seq], [len(token_ids)]))
    seq.sync(seq.token_ids, len(token_ids))
    cache.commit(seq, len(token_ids))
    return cache, seq, cached_kv(cache, seq, len(token_ids))


def assert_same_kv(got, expected) -> None:
    for (k, v), (k_ref, v_ref) in zip(got, expected, strict=True):
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def reference(build, target, make_requests) -> list[int]:
    seqs = build({"kv_cache": "none"}, target).engine.run(make_requests([PROMPT_LEN], [MAX_NEW]))
    return seqs[0].output_token_ids


def start(built, request: Request) -> Sequence:
    """Admit one request and run its prefill step."""
    seq = Sequence(request)
    built.engine.scheduler.add(seq)
    built.engine.step(built.engine.scheduler.next_batch())
    return seq


@pytest.mark.parametrize("num_good", [0, 2])
@pytest.mark.parametrize("kv_cache", default_registry().choices(Slot.KV_CACHE))
def test_target_cache_after_rejection(kv_cache, num_good, build, target, make_requests, reference):
    built = build({"kv_cache": kv_cache, "decoding": {"name": "speculative", "k": K}}, target)
    decoding = built.plugins[Slot.DECODING]
    decoding.drafter = ScriptedDrafter(reference, num_good, target.config.vocab_size)
    seq = start(built, make_requests([PROMPT_LEN], [MAX_NEW])[0])
    built.engine.step(built.engine.scheduler.next_batch())           # K drafts, num_good accepted

    assert decoding.counters.proposed == K and decoding.counters.accepted == num_good
    assert seq.output_token_ids == reference[:2 + num_good]           # prefill's, accepted, correction
    valid = seq.num_tokens - 1                                        # the correction is pending
    assert seq.num_computed_tokens == valid
    cache = built.kv_cache
    assert cache.bytes_used() == valid * cache.spec.bytes_per_token if cache.keeps_kv else cache.bytes_used() == 0
    if not cache.keeps_kv:
        return
    ref_cache, ref_seq, expected = fresh_kv(target, cache, built.engine.runner.attention, seq.token_ids[:valid])
    assert_same_kv(cached_kv(cache, seq, valid), expected)
    assert cache.bytes_used() == ref_cache.bytes_used()
    if kv_cache == "paged":                                           # blocks past the valid tokens freed
        for group in range(len(cache.groups)):                            # each group's table: (seq_id, group)
            assert cache.manager.num_tokens[seq.seq_id, group] == valid
            assert (len(cache.manager.block_table((seq.seq_id, group)))
                    == len(ref_cache.manager.block_table((ref_seq.seq_id, group))))
        assert cache.bytes_reserved() == ref_cache.bytes_reserved()
    # and decoding goes on to the target's greedy tokens
    while built.engine.scheduler.has_unfinished():
        built.engine.step(built.engine.scheduler.next_batch())
    assert seq.output_token_ids == reference


@pytest.mark.parametrize("kv_cache", KEEPING_CACHES)
def test_draft_cache_after_rejection(kv_cache, build, target, make_requests, reference):
    """The draft model's own cache forgets the drafts the target rejected (when its session next
    brings it up to date), holding exactly what a prefill of the kept tokens holds."""
    built = build({"kv_cache": kv_cache, "decoding": {"name": "speculative", "k": K, "drafter": "draft_model",
                                                      "draft_model": "tiny", "draft_overrides": {"seed": 1}}}, target)
    decoding = built.plugins[Slot.DECODING]
    seq = start(built, make_requests([PROMPT_LEN], [MAX_NEW])[0])
    while decoding.counters.accepted == decoding.counters.proposed:   # until a step rejects a draft
        built.engine.step(built.engine.scheduler.next_batch())
    session = decoding.drafter.session
    held = session.shadows[seq.seq_id][1].num_computed_tokens
    shadow = session.sync(seq, list(seq.token_ids))
    computed = shadow.num_computed_tokens
    # the draft computed the history and the drafts it fed; only the accepted ones stay
    assert computed <= held and computed <= seq.num_tokens - 1
    assert shadow.token_ids[:computed] == seq.token_ids[:computed]
    assert session.kv_cache.bytes_used() == computed * session.kv_cache.spec.bytes_per_token
    _, _, expected = fresh_kv(session.model, session.kv_cache, built.engine.runner.attention, seq.token_ids[:computed])
    assert_same_kv(cached_kv(session.kv_cache, shadow, computed), expected)
    while built.engine.scheduler.has_unfinished():
        built.engine.step(built.engine.scheduler.next_batch())
    assert seq.output_token_ids == reference
