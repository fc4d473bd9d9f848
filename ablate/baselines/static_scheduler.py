"""scheduler=static: form a batch, run it to completion, then take the next.

Finished sequences keep their cache room until the whole batch ends, and nothing joins a batch
once it has started: the batch waits for its slowest member.
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    def next_batch(self) -> Batch | None:
        if not self.batch:     # a new batch: as many waiting sequences as fit, each with its whole prompt
            while self.waiting and len(self.batch) < self.max_num_seqs:
                seq = self.waiting[0]
                if not self.admit(seq, seq.num_tokens):
                    break
                self.batch.append(self.waiting.popleft())
            return Batch(self.batch, [s.num_tokens for s in self.batch]) if self.batch else None
        active = [s for s in self.batch if not s.is_finished]
        for seq in active:                 # one decode token each
            if not self.grow(seq, 1):
                raise RuntimeError(
                    f"the KV cache has no room for sequence {seq.seq_id}'s next token and the static scheduler "
                    "cannot preempt: raise the KV budget or lower engine.max_num_seqs")
        return Batch(active, [1] * len(active)) if active else None

    def finish_step(self, batch: Batch) -> None:
        if all(s.is_finished for s in self.batch):      # the whole batch is done: free its room
            for seq in self.batch:
                self.release(seq)
            self.batch = []
