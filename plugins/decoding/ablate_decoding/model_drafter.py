"""Drafting with a model: k autoregressive passes of a (cheaper) Llama model over every sequence.

The drafter keeps its own KV cache (the same plugin as the target's) and, per sequence, a shadow
Sequence that says how many tokens that cache holds. Each propose first feeds whatever the draft has
not seen (the whole prompt the first time; then the token the target emitted last step, and the last
draft if it was accepted), then one token per pass. After verification `rollback` truncates the
draft's cache to the tokens the target kept, so it never holds a rejected draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api.step import Batch
from ablate.api.slots import KVCache
from ablate.model.llama import LlamaModel
from ablate.api.sequence import Sequence, Status
from ablate.engine.runner import ModelRunner
from ablate.api.sampling import Sampler, probabilities
from ablate_decoding.drafter import Drafter


@dataclass
class Shadow:
    """The draft's view of one sequence: `seq` is the target's, `draft` counts what the draft computed."""

    seq: Sequence
    draft: Sequence


class ModelDrafter(Drafter):
    def __init__(self, name: str, model: LlamaModel, kv_cache: KVCache, sampler: Sampler) -> None:
        self.name = name
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler           # the target's: one random stream per sequence for every draw
        self.runner: ModelRunner | None = None
        self.shadows: dict[int, Shadow] = {}
        self._passes = 0

    def prepare(self, target: ModelRunner) -> None:
        if self.runner is None:
            self.runner = ModelRunner(self.model, self.kv_cache, target.attention)
        self._forget_finished()

    def _forget_finished(self) -> None:
        """Free the draft cache of sequences that finished or were preempted."""
        for seq_id, shadow in list(self.shadows.items()):
            if shadow.seq.status is not Status.RUNNING:
                self.kv_cache.release(shadow.draft)
                del self.shadows[seq_id]

    def _shadow(self, seq: Sequence) -> Shadow | None:
        """The sequence's shadow with its tokens brought up to date; None: no room in the draft cache."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None or shadow.seq is not seq:
            draft = Sequence(seq.request)
            if not self.kv_cache.can_admit(draft):
                return None
            self.kv_cache.admit(draft)
            draft.status = Status.RUNNING
            shadow = self.shadows[seq.seq_id] = Shadow(seq, draft)
        shadow.draft.token_ids = list(seq.token_ids)   # rollback kept computed <= the common prefix
        return shadow

    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        assert self.runner is not None, "prepare() first"
        shadows = [self._shadow(seq) if k > 0 else None for seq, k in zip(seqs, num_drafts)]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(num_drafts, default=0)):
            active = []
            for i, shadow in enumerate(shadows):
                if shadow is None or num_drafts[i] <= j:
                    continue
                new = shadow.draft.num_tokens - shadow.draft.num_computed_tokens
                if self.kv_cache.grow(shadow.draft, new):
                    active.append((i, new))
                else:
                    shadows[i] = None          # no room: this sequence keeps the drafts it has
            if not active:
                break
            batch = Batch([shadows[i].draft for i, _ in active], [new for _, new in active])
            logits, _ = self.runner.forward(batch)                      # (B_active, V)
            self._passes += 1
            greedy = all(seqs[i].request.sampling.is_greedy for i, _ in active)
            argmax = logits.argmax(-1).tolist() if greedy else None     # one sync for the batch
            for row, (i, _) in enumerate(active):
                seq = seqs[i]
                if greedy:
                    token = argmax[row]
                else:
                    q = probabilities(logits[row:row + 1], seq.request.sampling)[0]   # (V,)
                    token = self.sampler.draw(q, seq)
                    probs[i].append(q)
                shadows[i].draft.token_ids.append(token)
                tokens[i].append(token)
        # greedy drafts are deterministic (q one-hot); sampled ones come with the q they were drawn from
        return tokens, [torch.stack(p) if p else None for p in probs]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            return
        keep = min(shadow.draft.num_computed_tokens, num_tokens)
        shadow.draft.num_computed_tokens = keep
        self.kv_cache.truncate(shadow.draft, keep)
        del shadow.draft.token_ids[keep:]

    def num_passes(self) -> int:
        return self._passes

    def bytes_reserved(self) -> int:
        return self.kv_cache.bytes_reserved()

    def close(self) -> None:
        for shadow in self.shadows.values():
            self.kv_cache.release(shadow.draft)
        self.shadows.clear()
        self.kv_cache.close()
