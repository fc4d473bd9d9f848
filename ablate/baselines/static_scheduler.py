"""scheduler=static: form a batch, run it to completion, then take the next.

Finished sequences keep their cache room until the whole batch ends, and nothing joins a batch
once it has started: the batch waits for its slowest member.

The batch's prefill respects engine.max_num_batched_tokens like every step: when its prompts do not
fit one step, they are fed over several, whole prompts per step where they fit, and a prompt longer
than a whole step in step-sized chunks (alone in its steps, so that a cache that recomputes the
prefix, kv_cache=none, recomputes no more than it must). Decoding starts once every prompt is in:
the same sequences then advance together, a token each per step, to the batch's end.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ablate.api import Batch, BuildContext, PluginConfig, Scheduler, Sequence


@dataclass
class StaticSchedulerConfig(PluginConfig):
    name: str = "static"


class StaticScheduler(Scheduler):
    name = "static"
    config_class = StaticSchedulerConfig

    def __init__(self, config: StaticSchedulerConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.waiting: deque[Sequence] = deque()
        self.batch: list[Sequence] = []   # the current static batch, finished members included
        # a decode step feeds a token for each member, so a batch has no more members than a step has tokens
        self.max_batch = min(self.max_num_seqs, self.max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    def next_batch(self) -> Batch | None:
        if not self.batch:     # a new batch: as many waiting sequences as fit, each with room for its whole prompt
            while self.waiting and len(self.batch) < self.max_batch:
                seq = self.waiting[0]
                if not self.admit(seq, seq.num_tokens):
                    break
                self.batch.append(self.waiting.popleft())
        prefilling = [s for s in self.batch if s.is_prefilling]
        if prefilling:
            return self._prefill_step(prefilling)
        active = [s for s in self.batch if not s.is_finished]
        for seq in active:                 # one decode token each
            if not self.grow(seq, 1):
                raise RuntimeError(
                    f"the KV cache has no room for sequence {seq.seq_id}'s next token and the static scheduler "
                    "cannot preempt: raise the KV budget or lower engine.max_num_seqs")
        return Batch(active, [1] * len(active)) if active else None

    def _prefill_step(self, prefilling: list[Sequence]) -> Batch:
        """The next prompts, in order, within one step's token budget: whole where they fit; the first
        one alone and cut to the budget when even it does not fit."""
        seqs, num_new = [], []
        budget = self.max_num_batched_tokens
        for seq in prefilling:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > budget:
                if not seqs:
                    seqs, num_new = [seq], [budget]
                break
            seqs.append(seq)
            num_new.append(remaining)
            budget -= remaining
        for seq, n in zip(seqs, num_new):
            # admission reserved the whole prompt; a step's commit keeps only what was computed, so a
            # prompt's later chunks ask for their room again (there is no one to preempt for it)
            if self.kv_cache.room(seq) < seq.num_computed_tokens + n and not self.grow(seq, n):
                raise RuntimeError(
                    f"the KV cache has no room for the next {n} prompt tokens of sequence {seq.seq_id} and the "
                    "static scheduler cannot preempt: raise the KV budget or engine.max_num_batched_tokens")
        return Batch(seqs, num_new)

    def finish_step(self, batch: Batch) -> None:
        if all(s.is_finished for s in self.batch):      # the whole batch is done: free its room
            for seq in self.batch:
                self.release(seq)
            self.batch = []
