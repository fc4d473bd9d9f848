"""The engine loop: admit arrivals, let the scheduler pick a batch, decode it, commit, retire.

The engine is the one place a step's outcome is committed: each sequence's emitted tokens and
computed count (Sequence.advance) and the tokens its cache keeps (KVCache.commit). It checks the
plugins' side of the contract as it goes, so that a broken plugin is a PluginError naming it, never
a silently wrong measurement: every batch (the scheduler's), every emission (the decoding's), and
after a run that every request finished and every plugin gave back what it held.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from ablate.api import clock
from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, blame
from ablate.api.sequence import Request, Sequence, Status
from ablate.api.slots import Decoding, Scheduler
from ablate.api.step import Batch, StepLogits
from ablate.engine.hooks import StepHook
from ablate.engine.runner import ModelRunner
from ablate.workload.arrivals import ArrivalQueue

MAX_IDLE_WAIT_S = 3600.0    # an arrival further away than this is a malformed workload, not a wait


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, decoding: Decoding, config: EngineConfig,
                 hooks: Iterable[StepHook] = ()) -> None:
        self.config = config            # the limits every batch is checked against (not the scheduler's copy)
        self.runner = runner
        self.kv_cache = runner.kv_cache
        self.scheduler = scheduler
        self.decoding = decoding
        self.hooks = list(hooks)
        self.device = runner.device
        self.seqs: dict[int, Sequence] = {}     # every sequence of the current run, by id

    # -- one step ----------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[int, list[int]]:
        """Run one batch; returns the tokens each sequence kept (seq_id -> tokens; none in a prompt chunk)."""
        self.checked(batch)
        # no sync at the start: what the device still runs when the host gets here is the last step's
        # tail, which ended with its clock's sync or its tokens' (or nothing records the steps' times)
        start = time.perf_counter()
        for hook in self.hooks:
            hook.on_step_start(batch, start)
        executor = StepExecutor(self.runner)
        with blame(self.decoding, "step"):
            emitted = self.decoding.step(executor, batch)
        end = clock.now(self.device) if any(h.times_device_work for h in self.hooks) else time.perf_counter()
        kept = self.commit(batch, emitted, executor.fed_drafts)
        for hook in self.hooks:
            hook.on_step_end(batch, kept, end)
        with blame(self.scheduler, "finish_step"):
            self.scheduler.finish_step(batch)
        for seq in batch.seqs:
            if seq.seq_id in kept and seq.is_finished:
                for hook in self.hooks:
                    hook.on_finish(seq, end)
        return kept

    def checked(self, batch: Batch) -> Batch:
        """The scheduler's batch, checked, with the draft room the cache holds beyond its new tokens
        filled in (num_lookahead_tokens)."""
        sched, limits = self.scheduler, self.config
        if not batch.seqs:
            raise PluginError(sched, "next_batch", "returned an empty batch (return None when nothing can run)")
        if len(batch) > limits.max_num_seqs:
            raise PluginError(sched, "next_batch", f"a batch of {len(batch)} sequences exceeds "
                              f"engine.max_num_seqs={limits.max_num_seqs}")
        if batch.num_tokens > limits.max_num_batched_tokens:
            raise PluginError(sched, "next_batch", f"a batch of {batch.num_tokens} tokens exceeds "
                              f"engine.max_num_batched_tokens={limits.max_num_batched_tokens}")
        if len({s.seq_id for s in batch.seqs}) != len(batch):
            raise PluginError(sched, "next_batch", "a sequence appears twice in one batch")
        holders = self.kv_cache.room_holders()
        if len(holders) > limits.max_num_seqs:
            done = self._finished(holders)
            raise PluginError(sched, "next_batch", f"{len(holders)} sequences hold room, more than "
                              f"engine.max_num_seqs={limits.max_num_seqs}" + (
                                  f"; {done} finished but still hold it (finish_step must release them)" if done else ""))
        lookahead = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not Status.RUNNING:
                raise PluginError(sched, "next_batch", f"sequence {seq.seq_id} is {seq.status.value}, not running")
            need = seq.num_computed_tokens + n
            if n < 1 or need > seq.num_tokens:
                raise PluginError(sched, "next_batch", f"sequence {seq.seq_id} feeds {n} new tokens but has "
                                  f"{seq.num_tokens - seq.num_computed_tokens} to feed")
            room = self.kv_cache.room(seq)
            if room < need:
                raise PluginError(sched, "next_batch", f"sequence {seq.seq_id} feeds up to token {need} but holds "
                                  f"room for {room}: call grow() (or admit()) before batching it")
            lookahead.append(room - need)
        batch.num_lookahead_tokens = lookahead
        return batch

    def commit(self, batch: Batch, emitted: dict[int, list[int]],
               fed_drafts: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
        """Apply the step: each sequence's new tokens and computed count, then what its cache keeps.
        fed_drafts: the draft tokens the step's forward pass fed (seq_id -> tokens). Returns the tokens
        each emitting sequence kept (a stop token or the length limit cuts the rest)."""
        if not isinstance(emitted, dict):
            raise PluginError(self.decoding, "step", f"returned {type(emitted).__name__}, expected a dict "
                              "seq_id -> emitted tokens")
        emitting = {seq.seq_id for seq, emits in zip(batch.seqs, batch.emits) if emits}
        if set(emitted) != emitting:
            missing, extra = sorted(emitting - set(emitted)), sorted(set(emitted) - emitting)
            raise PluginError(self.decoding, "step", f"must emit for exactly the sequences whose step reaches their "
                              f"last token (batch.emits); missing {missing}, unexpected {extra}")
        kept: dict[int, list[int]] = {}
        fed = fed_drafts or {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = emitted.get(seq.seq_id)
            if tokens is not None:
                drafts = fed.get(seq.seq_id, [])
                if not tokens or tokens[:-1] != drafts[:len(tokens) - 1]:
                    raise PluginError(self.decoding, "step", f"sequence {seq.seq_id} emitted {tokens} after feeding "
                                      f"drafts {drafts}: emit one token or more, all but the last being fed drafts, in order")
                kept[seq.seq_id] = seq.advance(n, tokens)
            else:
                seq.advance(n, [])
            self.kv_cache.commit(seq, seq.num_computed_tokens)
        return kept

    # -- a whole workload --------------------------------------------------------------------------
    def run(self, requests: Seq[Request]) -> list[Sequence]:
        """Serve the requests, each arriving at its arrival_time after the start (real time), or,
        one that follows another (Request.follows), its arrival_time after that one finishes: its
        arrival is recorded as that moment, so that its TTFT and E2E count from when it was sent.

        Returns every sequence, in request order, all finished; raises PluginError when a plugin
        lost a request, stalled, or kept room after the run.
        """
        queue = ArrivalQueue(requests)
        self._check_gaps(sorted(requests, key=lambda r: r.arrival_time))
        self.seqs = {}
        t0 = clock.now(self.device)
        release = _ReleaseFollowers(queue, t0)    # a finish (timed at its step's end) makes its followers due
        self.hooks.append(release)
        try:
            steps_without_output, patience = 0, self._patience(requests)
            while not queue.empty or self.scheduler.has_unfinished():
                for arrival_s, request in queue.due(time.perf_counter() - t0):
                    seq = Sequence(request)
                    self.seqs[seq.seq_id] = seq
                    with blame(self.scheduler, "add"):
                        self.scheduler.add(seq)
                    for hook in self.hooks:
                        hook.on_arrival(seq, t0 + arrival_s)
                with blame(self.scheduler, "next_batch"):
                    batch = self.scheduler.next_batch()
                if batch is not None:
                    kept = self.step(batch)
                    steps_without_output = 0 if kept else steps_without_output + 1
                    if steps_without_output > patience:
                        raise PluginError(self.scheduler, "next_batch", f"{patience} steps in a row emitted no "
                                          "token: sequences are preempted or fed forever without progress")
                elif (next_s := queue.next_time()) is not None:     # idle until the next request arrives
                    # bounded by MAX_IDLE_WAIT_S: _check_gaps refused longer gaps before the run
                    time.sleep(max(0.0, next_s - (time.perf_counter() - t0)))
                else:     # nothing runs, nothing is due: the rest wait on sequences that make no progress
                    raise self._stalled([s for s in self.seqs.values() if not s.is_finished])
        finally:
            self.hooks.remove(release)
        self._check_after_run()
        return sorted(self.seqs.values(), key=lambda s: s.seq_id)

    @staticmethod
    def _check_gaps(pending: list[Request]) -> None:
        """No wait for an arrival may exceed MAX_IDLE_WAIT_S: refuse such a workload before it starts.
        Gaps are between timed arrivals; a request that follows another waits its own think time."""
        previous = 0.0
        for request in pending:
            if request.follows is not None:
                if request.arrival_time > MAX_IDLE_WAIT_S:
                    raise ValueError(f"request {request.request_id} waits {request.arrival_time:.0f} s after request "
                                     f"{request.follows} finishes (more than {MAX_IDLE_WAIT_S:.0f} s of idling): "
                                     "check workload.think_time_s")
                continue
            if request.arrival_time - previous > MAX_IDLE_WAIT_S:
                raise ValueError(
                    f"request {request.request_id} arrives at {request.arrival_time:.0f} s, "
                    f"{request.arrival_time - previous:.0f} s after the one before (more than {MAX_IDLE_WAIT_S:.0f} s "
                    "of idling): arrival times are seconds after the workload starts, not Unix times; check "
                    "workload.rate, workload.textbook_arrival_s or the trace")
            previous = request.arrival_time

    @staticmethod
    def _patience(requests: Seq[Request]) -> int:
        """Steps without output before a run is called stuck: more than prefilling every prompt
        one token a step would take."""
        return 2 * sum(len(r.prompt_token_ids) + r.max_new_tokens for r in requests) + 100

    def _stalled(self, stuck: list[Sequence]) -> PluginError:
        """Why nothing runs although sequences wait: the cache cannot hold them, or the scheduler."""
        ids = [s.seq_id for s in stuck]
        if not stuck:
            return PluginError(self.scheduler, "has_unfinished", "says sequences remain but every one has finished")
        holders = self.kv_cache.room_holders()
        done = self._finished(holders)
        if done and len(done) == len(holders):
            return PluginError(self.scheduler, "finish_step", f"sequences {done} finished but still hold room while "
                               f"sequences {ids} wait: finish_step must release them")
        if self.kv_cache.num_seqs_admitted() > len(holders):
            return PluginError(self.kv_cache, "free", f"reports {self.kv_cache.num_seqs_admitted()} sequences admitted "
                               f"but only {len(holders)} were not released: free() must give back what a sequence held")
        if not holders:
            probe = stuck[0]
            if probe.status is Status.WAITING and self.kv_cache.allocate(probe, probe.num_tokens):
                self.kv_cache.release(probe)
                return PluginError(self.scheduler, "next_batch", f"returns nothing while sequences {ids} wait and "
                                   f"the empty KV cache ({self.kv_cache}) has room for sequence {probe.seq_id}")
            return PluginError(self.kv_cache, "reserve", f"cannot hold sequence {probe.seq_id} ({probe.num_tokens} "
                               f"tokens, up to {probe.max_num_tokens}) even when it holds no other sequence: "
                               "raise the KV budget, or free() does not give back what a sequence held")
        return PluginError(self.scheduler, "next_batch", f"returns nothing while sequences {ids} wait and "
                           f"{self.kv_cache.num_seqs_admitted()} sequences hold room")

    def _finished(self, seq_ids: list[int]) -> list[int]:
        """Those of `seq_ids` that are finished sequences of this run."""
        return sorted(i for i in seq_ids if i in self.seqs and self.seqs[i].is_finished)

    def _check_after_run(self) -> None:
        unfinished = [i for i, s in self.seqs.items() if not s.is_finished]
        if unfinished:
            raise PluginError(self.scheduler, "has_unfinished", f"returned False while sequences {unfinished} never "
                              "finished: a scheduler must keep every request it was given until it finishes")
        if self.scheduler.has_unfinished():
            raise PluginError(self.scheduler, "has_unfinished", "still True after every sequence finished")
        cache = self.kv_cache
        if cache.room_holders():
            raise PluginError(self.scheduler, "finish_step", f"sequences {sorted(cache.room_holders())} finished but "
                              "their room was never released")
        if cache.num_seqs_admitted():
            raise PluginError(cache, "free", f"reports {cache.num_seqs_admitted()} sequences admitted after every "
                              "sequence was released: free() must give back what a sequence held")
        if cache.bytes_used():
            raise PluginError(cache, "bytes_used", f"reports {cache.bytes_used()} bytes used after every sequence "
                              "was released")


class StepExecutor:
    """The Executor one step's decoding runs on: the runner's forward pass, and the draft tokens it
    fed, which the engine's commit checks the emitted tokens against."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.device = runner, runner.device
        self.fed_drafts: dict[int, list[int]] = {}      # seq_id -> draft tokens fed (none empty)

    def forward(self, batch: Batch, draft_tokens: dict[int, list[int]] | None = None) -> StepLogits:
        self.fed_drafts = {k: v for k, v in (draft_tokens or {}).items() if v}
        return self.runner.forward(batch, self.fed_drafts)


class _ReleaseFollowers(StepHook):
    """Tells the arrival queue when a sequence finished (the end of its last step, as the other hooks
    see it), so that the requests following it become due from that moment."""

    def __init__(self, queue: ArrivalQueue, t0: float) -> None:
        self.queue, self.t0 = queue, t0

    def on_finish(self, seq: Sequence, at: float) -> None:
        self.queue.finished(seq.seq_id, at - self.t0)
