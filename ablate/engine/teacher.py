"""Teacher forcing through an arm's runner: feed given texts token by token, as decoding would feed
what it emits, and collect the logits that predict each next token.

The first `num_prefill` tokens of each text (one count, or one per text) go in as one prompt step, then every further token in a
step of its own, all texts in lockstep (a batch). So a cache that evicts, compresses or mixes up
sequences acts on the scored text exactly as it would on generated text. Used for perplexity
through an arm (ablate.measure.quality) and by the conformance kit (batched vs one at a time).
"""
from __future__ import annotations

import torch

from ablate.api.plugin import PluginError
from ablate.api.sequence import Request, Sequence
from ablate.api.step import Batch
from ablate.engine.runner import ModelRunner


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, texts: list[list[int]],
                          num_prefill: int | list[int] = 1) -> list[torch.Tensor]:
    """Per text (n tokens), logits (n - p, V) fp32, p its num_prefill: row r predicts token p + r."""
    prefills = num_prefill if isinstance(num_prefill, list) else [num_prefill] * len(texts)
    for text, p in zip(texts, prefills, strict=True):
        if not 1 <= p < len(text):
            raise ValueError(f"need 1 <= num_prefill < len(text), got num_prefill={p} for {len(text)} tokens")
    cache = runner.kv_cache
    seqs = [Sequence(Request(i, tuple(text[:p]), max_new_tokens=len(text) - p))
            for i, (text, p) in enumerate(zip(texts, prefills))]
    scored: list[list[torch.Tensor]] = [[] for _ in texts]
    try:
        for seq in seqs:
            seq.start()
        while live := [s for s in seqs if not s.is_finished]:
            num_new = [s.num_tokens - s.num_computed_tokens for s in live]
            for seq, n in zip(live, num_new):
                if not cache.allocate(seq, n):
                    raise PluginError(cache, "reserve", f"no room for token {seq.num_tokens} of text {seq.seq_id} "
                                      f"({len(live)} texts at once)")
            out = runner.forward(Batch(live, num_new))                     # one row per text
            for row, (seq, n) in enumerate(zip(live, num_new)):
                text = texts[seq.seq_id]
                scored[seq.seq_id].append(out.logits[row].float())
                seq.advance(n, [text[seq.num_tokens]])                     # the true next token
                cache.commit(seq, seq.num_computed_tokens)
    finally:
        for seq in seqs:
            cache.release(seq)
    return [torch.stack(rows) for rows in scored]
