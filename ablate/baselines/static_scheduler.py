"""scheduler=static: form a batch, run it to completion, then take the next.

Finished sequences keep their cache room until the whole batch ends, and nothing joins a batch
once it has started: the batch waits for its slowest member.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ablate.api.step import Batch
from ablate.api.context import BuildContext
from ablate.api.slots import Scheduler
from ablate.api.plugin import PluginConfig
from ablate.api.sequence import Sequence, Status


@dataclass
class StaticSchedulerConfig(PluginConfig):
    name: str = "static"


class StaticScheduler(Scheduler):
    name = "static"
    config_class = StaticSchedulerConfig

    def __init__(self, config: StaticSchedulerConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.kv_cache = ctx.kv_cache
        self.max_num_seqs = ctx.engine.max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.batch: list[Sequence] = []   # the current static batch, finished members included

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    @property
    def num_running(self) -> int:
        return sum(not s.is_finished for s in self.batch)

    def next_batch(self) -> Batch | None:
        if not self.batch:
            while self.waiting and len(self.batch) < self.max_num_seqs and self.kv_cache.can_admit(self.waiting[0]):
                seq = self.waiting.popleft()
                self.kv_cache.admit(seq)
                seq.status = Status.RUNNING
                self.batch.append(seq)
        active = [s for s in self.batch if not s.is_finished]
        if not active:
            return None
        num_new = [s.num_tokens - s.num_computed_tokens for s in active]   # whole prompt, then 1
        for seq, n in zip(active, num_new):
            if not self.kv_cache.grow(seq, n):
                raise RuntimeError(
                    f"the KV cache has no room for sequence {seq.seq_id} and the static scheduler "
                    "cannot preempt: raise the KV budget or lower engine.max_num_seqs"
                )
        return Batch(active, num_new)

    def finish_step(self, batch: Batch, emitted: dict[int, list[int]]) -> list[Sequence]:
        finished = []
        for seq in batch.seqs:
            if seq.finish_reason is not None:
                seq.status = Status.FINISHED
                finished.append(seq)
        if all(s.is_finished for s in self.batch):      # the whole batch is done: free its room
            for seq in self.batch:
                self.kv_cache.release(seq)
            self.batch = []
        return finished
