"""Drafting with a model: k autoregressive passes of a (cheaper) Llama model over every sequence.

The model runs in a ModelSession (ctx.model_session): its own KV cache, of the arm's kv_cache
plugin, that the session keeps in step with the target's sequences. Pass j asks it for the logits
after each sequence's tokens and its first j drafts; the session feeds what its cache has not seen
(the whole prompt the first time, then what the target emitted since) and forgets the drafts the
target rejected, so this drafter keeps no per-sequence state of its own.
"""
from __future__ import annotations

import torch

from ablate.api import ModelSession, Sampler, Sequence, greedy as greedy_tokens, probabilities
from ablate_decoding.drafter import Drafter


class ModelDrafter(Drafter):
    def __init__(self, name: str, session: ModelSession, sampler: Sampler) -> None:
        self.name = name
        self.session = session
        self.sampler = sampler           # the target's: one random stream per sequence for every draw

    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        for j in range(max(num_drafts, default=0)):
            active = [i for i in active if num_drafts[i] > j]
            if not active:
                break
            logits, has_room = self.session.next_logits([seqs[i] for i in active], [tokens[i] for i in active])
            active = [i for i, ok in zip(active, has_room) if ok]     # no room: it keeps the drafts it has
            greedy = all(seqs[i].request.sampling.is_greedy for i in active)
            argmax = greedy_tokens(logits) if greedy else None         # one sync for the batch
            for row, i in enumerate(active):
                seq = seqs[i]
                if greedy:
                    token = argmax[row]
                else:
                    q = probabilities(logits[row:row + 1], seq.request.sampling)[0]   # (V,)
                    token = self.sampler.draw(q, seq)
                    probs[i].append(q)
                tokens[i].append(token)
        # greedy drafts are deterministic (q one-hot); sampled ones come with the q they were drawn from
        return tokens, [torch.stack(p) if p else None for p in probs]

    def num_passes(self) -> int:
        return self.session.num_passes()

    def bytes_reserved(self) -> int:
        return self.session.bytes_reserved()

    def close(self) -> None:
        self.session.close()
