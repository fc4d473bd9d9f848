"""A second model run over the engine's sequences with a KV cache of its own (ablate.api.ModelSession).

A model drafter proposes with it: a draft model, or a subset of the target's layers. Per target
sequence the session keeps a shadow Sequence that counts what its own cache holds; on each call it
brings the shadow up to the tokens it is asked about (the target's tokens plus the drafts so far):
the longest common prefix with what it holds stays, the rest of its cache is rolled back (rejected
drafts) and whatever it has not computed is fed. It is the scheduler and the engine of its cache:
it allocates, commits and releases, and nothing else changes its shadows.
"""
from __future__ import annotations

import torch

from ablate.api.kv_cache import KVCache
from ablate.api.sequence import Request, Sequence, Status
from ablate.api.slots import Attention
from ablate.api.step import Batch
from ablate.engine.runner import ModelRunner
from ablate.model.llama import LlamaModel


class Shadow(Sequence):
    """The session's view of one target sequence: the tokens it knows and how many its cache holds
    (Sequence.sync sets both)."""

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.start()


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit          # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


class ModelRunSession:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, attention: Attention) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.runner = ModelRunner(model, kv_cache, attention)
        # a drafter's NaN would only cost acceptance, never the text: no sync mid-step to check it
        self.runner.logits_checked = True
        self.shadows: dict[int, tuple[Sequence, Shadow]] = {}    # seq_id -> (target, shadow)
        self._passes = 0

    def next_logits(self, seqs: list[Sequence], tails: list[list[int]]) -> tuple[torch.Tensor, list[bool]]:
        self._forget_finished()
        batch_seqs, num_new, mask = [], [], []
        for seq, tail in zip(seqs, tails):
            shadow = self.sync(seq, seq.token_ids + tail)
            mask.append(shadow is not None)
            if shadow is not None:
                batch_seqs.append(shadow)
                num_new.append(shadow.num_tokens - shadow.num_computed_tokens)
        if not batch_seqs:
            return torch.empty(0, self.model.config.vocab_size, device=self.runner.device), mask
        batch = Batch(batch_seqs, num_new)
        logits = self.runner.forward(batch).logits                   # (B', V): one row each, at its last token
        self._passes += 1
        for shadow in batch_seqs:
            shadow.sync(shadow.token_ids, shadow.num_tokens)       # everything it was fed is computed
            self.kv_cache.commit(shadow, shadow.num_tokens)
        return logits, mask

    def sync(self, seq: Sequence, tokens: list[int]) -> Shadow | None:
        """The shadow of `seq` brought up to `tokens` (a list the session keeps: pass a fresh one): its
        cache keeps their longest prefix it holds (what no longer matches, rejected drafts, is rolled
        back) and has room for the rest; None when there is no room (then no drafts this step)."""
        held = self.shadows.get(seq.seq_id)
        if held is None or held[0] is not seq:
            if held is not None:
                self._release(seq.seq_id)
            shadow = Shadow(seq.request)
            shadow.sync(tokens, 0)
            if not self.kv_cache.allocate(shadow, len(tokens)):
                return None
            self.shadows[seq.seq_id] = (seq, shadow)
            return shadow
        shadow = held[1]
        # keep at most len(tokens) - 1: the last token is fed again to get the logits after it
        keep = common_prefix_len(shadow.token_ids, tokens, min(shadow.num_computed_tokens, len(tokens) - 1))
        rolled_back = keep < shadow.num_computed_tokens
        shadow.sync(tokens, keep)
        if rolled_back:
            self.kv_cache.commit(shadow, keep)                      # forget what no longer matches
        if not self.kv_cache.allocate(shadow, len(tokens) - keep):
            return None
        return shadow

    def _forget_finished(self) -> None:
        """Release the shadows of target sequences that finished or were preempted."""
        for seq_id, (seq, _) in list(self.shadows.items()):
            if seq.status is not Status.RUNNING:
                self._release(seq_id)

    def _release(self, seq_id: int) -> None:
        _, shadow = self.shadows.pop(seq_id)
        self.kv_cache.release(shadow)

    def num_passes(self) -> int:
        return self._passes

    def bytes_reserved(self) -> int:
        return self.kv_cache.bytes_reserved()

    def close(self) -> None:
        for seq_id in list(self.shadows):
            self._release(seq_id)
        self.kv_cache.close()
