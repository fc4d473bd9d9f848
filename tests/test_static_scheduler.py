"""scheduler=static within engine.max_num_batched_tokens: a batch whose prompts exceed one step is
prefilled over several steps (whole prompts where they fit, a prompt longer than a step in chunks),
never feeds more than the limit, stays one static batch (nobody joins until all have finished), and
gives the same greedy tokens as the same batch prefilled in one step, with every kind of cache."""
from __future__ import annotations

import pytest

from ablate.api.context import EngineConfig
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.hooks import StepHook


class Steps(StepHook):
    """Each step's (seq_id, new tokens) pairs."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def on_step_start(self, batch, at: float) -> None:
        self.batches.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])


def serve(registry, tiny_model, kv_cache: str, requests, max_num_seqs: int, max_num_batched_tokens: int):
    arm = resolve_arm("static", {"kv_cache": kv_cache}, baseline_configs(registry), registry)
    steps = Steps()
    built = build_arm(arm, tiny_model, EngineConfig(max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens),
                      64, registry, lambda cache: [steps])
    seqs = built.engine.run(requests)
    return {s.seq_id: s.output_token_ids for s in seqs}, steps.batches


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
@pytest.mark.parametrize("prompt_lens, max_num_seqs, limit", [
    ([20, 20, 20, 20], 4, 45),       # two whole prompts a step
    ([30, 9, 40, 5, 12], 3, 16),     # prompts longer than a step, chunked alone; the rest packed
    ([13, 13, 13], 8, 2),            # fewer tokens a step than sequences: a batch of 2 at most
], ids=["whole-prompts", "chunks", "tiny-limit"])
def test_a_static_batch_is_prefilled_within_the_token_limit_and_runs_to_its_end_together(
        registry, tiny_model, make_requests, kv_cache, prompt_lens, max_num_seqs, limit):
    requests = make_requests(prompt_lens, [4, 6, 3, 5, 2][:len(prompt_lens)])
    reference, one_step = serve(registry, tiny_model, kv_cache, requests, max_num_seqs, 4096)
    outputs, batches = serve(registry, tiny_model, kv_cache, requests, max_num_seqs, limit)
    assert outputs == reference
    assert max(sum(n for _, n in batch) for batch in batches) <= limit
    assert len(batches) > len(one_step)               # the limit did split the prefill
    # static: once a batch decodes, nobody joins it until every member has finished; prefill steps feed prompts only
    lens = {r.request_id: len(r.prompt_token_ids) for r in requests}
    total = {r.request_id: lens[r.request_id] + r.max_new_tokens - 1 for r in requests}   # tokens fed in all
    fed: dict[int, int] = {}
    decoding = False
    for batch in batches:
        unfinished = {i for i in fed if fed[i] < total[i]}
        if not unfinished:
            decoding = False                            # the batch ended: the next one may form
        newcomers = {i for i, _ in batch if i not in fed}
        assert not (decoding and newcomers), f"{newcomers} joined a static batch that was decoding"
        prefill = [fed.get(i, 0) < lens[i] for i, _ in batch]
        assert all(prefill) or not any(prefill), "decode tokens mixed into a prefill step"
        decoding = decoding or not any(prefill)
        for i, n in batch:
            fed[i] = fed.get(i, 0) + n
        assert len({i for i in fed if fed[i] < total[i]} | {i for i, _ in batch}) <= min(max_num_seqs, limit)
    assert fed == total             # every prompt token and every output token but the last, fed once
