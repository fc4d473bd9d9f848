"""The engine loop: admit arrivals, let the scheduler pick a batch, decode it, retire what finished."""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence as Seq

from ablate.measure import device as dev
from ablate.api.step import Batch
from ablate.api.slots import Decoding, Scheduler
from ablate.measure.recorder import StepHook
from ablate.api.sequence import Request, Sequence
from ablate.engine.runner import ModelRunner


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, decoding: Decoding,
                 hooks: Iterable[StepHook] = ()) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.decoding = decoding
        self.hooks = list(hooks)
        self.device = runner.device

    def step(self, batch: Batch) -> list[Sequence]:
        """Run one batch; returns the sequences that finished."""
        start = dev.now(self.device)
        for hook in self.hooks:
            hook.on_step_start(batch, start)
        emitted = self.decoding.step(self.runner, batch)
        end = dev.now(self.device)
        kept = {}
        for seq in batch.seqs:
            if seq.seq_id in emitted:
                kept[seq.seq_id] = seq.append(emitted[seq.seq_id])
        for hook in self.hooks:
            hook.on_step_end(batch, kept, end)
        finished = self.scheduler.finish_step(batch, kept)
        for seq in finished:
            for hook in self.hooks:
                hook.on_finish(seq, end)
        return finished

    def run(self, requests: Seq[Request]) -> list[Sequence]:
        """Serve the requests, each arriving at its arrival_time after the start (real time).

        Returns every sequence, finished, in request order.
        """
        pending = sorted(requests, key=lambda r: r.arrival_time)
        seqs: list[Sequence] = []
        t0 = dev.now(self.device)
        while pending or self.scheduler.has_unfinished():
            elapsed = time.perf_counter() - t0
            while pending and pending[0].arrival_time <= elapsed:
                seq = Sequence(pending.pop(0))
                seqs.append(seq)
                self.scheduler.add(seq)
                for hook in self.hooks:
                    hook.on_arrival(seq, t0 + seq.request.arrival_time)
            batch = self.scheduler.next_batch()
            if batch is not None:
                self.step(batch)
            elif pending:     # idle until the next request arrives
                time.sleep(max(0.0, pending[0].arrival_time - (time.perf_counter() - t0)))
            else:
                stuck = [s.seq_id for s in seqs if not s.is_finished]
                raise RuntimeError(
                    f"sequences {stuck} can never run: the KV cache cannot admit them "
                    "(a sequence longer than the KV budget allows?)"
                )
        return sorted(seqs, key=lambda s: s.seq_id)
