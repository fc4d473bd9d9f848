"""Per-request timestamps and per-step counters, gathered through the engine's hooks (a Recorder is a
StepHook, ablate.engine.hooks)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ablate.analysis.analytic import CostModel
from ablate.api.kv_cache import KVCache
from ablate.api.sequence import Sequence
from ablate.api.step import Batch
from ablate.engine.hooks import StepHook


@dataclass
class RequestRecord:
    request_id: int
    arrival: float                      # absolute clock (perf_counter) of the scheduled arrival
    num_prompt_tokens: int
    emissions: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens emitted)
    finish: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled: float | None = None   # start of the first step that fed it (queueing ends there)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.emissions)


@dataclass
class StepRecord:
    start: float
    end: float
    num_seqs: int
    num_tokens: int             # tokens fed (new ones; the whole prefix without a cache)
    num_prefill_seqs: int       # sequences still in their prompt this step
    kv_bytes_reserved: int
    kv_bytes_used: int
    flops: float = 0.0          # analytic cost of what the step fed (ablate.analysis.analytic)
    bytes: float = 0.0
    num_seqs_admitted: int = 0  # sequences holding KV-cache room at the step's end (a budget limits them)


class Recorder(StepHook):
    times_device_work = True      # per-step times (TPOT, ITL, decode step time)

    def __init__(self, kv_cache: KVCache, cost_model: CostModel | None = None) -> None:
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self.requests: dict[int, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self._step_start = 0.0
        self._prefill_seqs = 0
        self._cost = (0.0, 0.0)

    def on_arrival(self, seq: Sequence, at: float) -> None:
        self.requests[seq.seq_id] = RequestRecord(seq.seq_id, at, seq.num_prompt_tokens)

    def on_step_start(self, batch: Batch, at: float) -> None:
        self._step_start = at
        self._prefill_seqs = sum(s.is_prefilling for s in batch.seqs)
        for seq in batch.seqs:
            rec = self.requests.get(seq.seq_id)
            if rec is not None and rec.first_scheduled is None:
                rec.first_scheduled = at
        if self.cost_model is not None:
            keeps = self.kv_cache.keeps_kv
            ctx = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)]
            q = list(batch.num_new_tokens) if keeps else ctx
            logits = sum(c == s.num_tokens for s, c in zip(batch.seqs, ctx))
            cost = self.cost_model.step(q, ctx, logits)
            self._cost = (cost.flops, cost.bytes)

    def on_step_end(self, batch: Batch, emitted: dict[int, list[int]], at: float) -> None:
        for seq_id, tokens in emitted.items():
            if tokens:
                self.requests[seq_id].emissions.append((at, len(tokens)))
        fed = batch.num_tokens if self.kv_cache.keeps_kv else sum(s.num_computed_tokens for s in batch.seqs)
        self.steps.append(StepRecord(self._step_start, at, len(batch), fed, self._prefill_seqs,
                                     self.kv_cache.bytes_reserved(), self.kv_cache.bytes_used(), *self._cost,
                                     num_seqs_admitted=self.kv_cache.num_seqs_admitted()))

    def on_finish(self, seq: Sequence, at: float) -> None:
        rec = self.requests[seq.seq_id]
        rec.finish, rec.finish_reason, rec.num_preemptions = at, seq.finish_reason, seq.num_preemptions

