"""scheduler=continuous: iteration-level scheduling (Orca; the scheduler of vLLM and nano-vllm).

At every step finished sequences leave and waiting ones join, within engine.max_num_seqs
sequences and engine.max_num_batched_tokens tokens, and prefill and decode share the step. Running
sequences go first, oldest first (a decode token each, or their prompt's next chunk), so none
waits behind a newcomer; then waiting sequences join in arrival order while the cache admits them
and the token budget lasts. With chunked prefill a prompt that does not fit the step's budget (or
is longer than prefill_chunk) is split across steps, so a long prompt never stalls the decodes.

When the cache cannot grow a running sequence, the newest running sequence is preempted: its room
is released and it returns to the front of the queue with nothing computed, and nobody is admitted
until a sequence finishes (until then the cache has no more room than when it had to preempt). Admitted again, it
recomputes its prompt and the tokens it had emitted in one prefill (recompute, not swap), and then
continues exactly as it would have: a greedy sequence's tokens do not depend on the preemption.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ablate.api import Batch, BuildContext, PluginConfig, Scheduler, Sequence


@dataclass
class ContinuousConfig(PluginConfig):
    name: str = "continuous"
    chunked_prefill: bool = False   # split prompts across steps (fit the step's token budget, at most prefill_chunk)
    prefill_chunk: int = 512        # with chunked_prefill: most prompt tokens a sequence feeds per step; 0: no limit

    def __post_init__(self) -> None:
        if self.prefill_chunk < 0:
            raise ValueError(f"scheduler.prefill_chunk must be >= 0, got {self.prefill_chunk}")


class ContinuousScheduler(Scheduler):
    name = "continuous"
    config_class = ContinuousConfig
    preempts = True      # _grow_or_preempt: the newest running sequence gives its room back

    def __init__(self, config: ContinuousConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # in admission order: the newest last, preempted first
        # a preemption happened and no sequence has finished since: running sequences only grow, so
        # the cache has no more room than when it had to preempt, and a newcomer would be preempted again
        self.under_pressure = False

    def add(self, seq: Sequence) -> None:
        if not self.config.chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}'s prompt of {seq.num_tokens} tokens does not fit one step of "
                f"engine.max_num_batched_tokens={self.max_num_batched_tokens}: raise it or set "
                "scheduler.chunked_prefill=true")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_new_tokens(self, seq: Sequence, budget: int, num_computed: int) -> int:
        """Tokens `seq` feeds this step within `budget` tokens, once `num_computed` are computed: 1 when
        decoding, else its prompt or a chunk of it; 0 when it does not fit this step.

        A recompute after preemption longer than a whole step's budget is split even without
        chunked_prefill: unsplit it could never run.
        """
        remaining = seq.num_tokens - num_computed
        if self.config.chunked_prefill:
            limit = min(budget, self.config.prefill_chunk) if self.config.prefill_chunk else budget
            return min(remaining, limit)
        if remaining > self.max_num_batched_tokens:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def next_batch(self) -> Batch | None:
        seqs: list[Sequence] = []
        num_new: list[int] = []
        budget = self.max_num_batched_tokens
        waiting_before = len(self.waiting)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._num_new_tokens(seq, budget, seq.num_computed_tokens)
            if n and self._grow_or_preempt(seq, n):
                seqs.append(seq)
                num_new.append(n)
                budget -= n
            if seq in self.running:       # not preempted: the next one (preemption only removes the tail)
                i += 1
        self.under_pressure = (self.under_pressure or len(self.waiting) > waiting_before) and bool(self.running)
        # newcomers wait while the running ones had to give up room: they would only be preempted next
        while self.waiting and not self.under_pressure and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = self.kv_cache.num_cached_tokens(seq)
            n = self._num_new_tokens(seq, budget, cached)
            if n == 0 or not self.admit(seq, n, cached):
                break                      # first come, first served: nobody overtakes the head
            self.running.append(self.waiting.popleft())
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        return Batch(seqs, num_new) if seqs else None

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for `num_tokens` more of `seq`, preempting the newest running sequences until it fits.

        False: `seq` itself was the newest left and has been preempted.
        """
        while not self.grow(seq, num_tokens):
            victim = self.running.pop()
            self.preempt(victim)
            self.waiting.appendleft(victim)      # first in line again: it arrived before the waiting ones
            if victim is seq:
                return False
        return True

    def finish_step(self, batch: Batch) -> None:
        for seq in batch.seqs:
            if seq.is_finished and seq in self.running:
                self.running.remove(seq)
                self.release(seq)
                self.under_pressure = False          # room came back
