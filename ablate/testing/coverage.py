"""What a kit scenario actually made a plugin do, counted while it runs, and the states it must reach.

A scenario exists to put a plugin in a state (a full cache, a preempted sequence, a batch mixing
greedy and sampled requests...). A plugin that never gets there passes whatever it would do there,
so the kit counts what happened and fails a scenario that did not reach its states, saying which.

Counted from the engine's step hooks and from the cache's `allocate`, the one call through which a
scheduler asks for room (admission: the sequence holds none yet; growth: it does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ablate.api.kv_cache import KVCache
from ablate.api.sequence import Sequence
from ablate.api.step import Batch
from ablate.engine.hooks import StepHook

# the states a scenario can require, and what each means when it is missing
STATES = {
    "admissions_refused": "no admission was ever refused by the cache",
    "pressure": "the KV cache never refused room: its budget was never exhausted",
    "preemptions": "no sequence was ever preempted",
    "resumed": "no preempted sequence was ever admitted again",
    "chunk_before_emitter": "no step placed a prompt chunk that emits nothing before a sequence that emits",
    "mixed_batches": "no step mixed greedy and sampled requests",
    "top_p_below_1": "no request sampled with top_p < 1",
    "several_temperatures": "requests sampled at fewer than two temperatures",
}


@dataclass
class Coverage:
    """Counters of one scenario, over every run of its arm."""

    admissions_refused: int = 0     # the cache had no room for a sequence it did not hold yet
    growths_refused: int = 0        # ... for more tokens of a sequence it held
    preemptions: int = 0
    resumed: int = 0                # admissions of a sequence preempted before
    steps: int = 0
    chunk_before_emitter: int = 0   # steps with a non-emitting prompt chunk ahead of an emitting sequence
    mixed_batches: int = 0          # steps whose emitting sequences are both greedy and sampled
    temperatures: set[float] = field(default_factory=set)
    top_ps: set[float] = field(default_factory=set)
    budget_bytes: int = 0           # the cache's budget (0: none)
    peak_reserved_bytes: int = 0    # the most bytes_reserved() at a step's end

    @property
    def pressure(self) -> int:
        """Refusals by the cache: its room ran out."""
        return self.admissions_refused + self.growths_refused

    @property
    def top_p_below_1(self) -> int:
        return sum(p < 1 for p in self.top_ps)

    @property
    def several_temperatures(self) -> int:
        return int(len({t for t in self.temperatures if t > 0}) >= 2)

    def missing(self, states: tuple[str, ...]) -> list[str]:
        """What of `states` this scenario never reached, in words."""
        return [STATES[s] for s in states if not getattr(self, s)]

    def add_finished(self, seqs: list[Sequence]) -> None:
        self.preemptions += sum(s.num_preemptions for s in seqs)


class CoverageHook(StepHook):
    """Counts a built arm's steps and, by wrapping its cache's allocate on the instance (the kit's
    own instrumentation: the engine and the plugin are unchanged), the room it refused."""

    def __init__(self, cache: KVCache, budget_bytes: int = 0) -> None:
        self.cache = cache
        self.coverage = Coverage(budget_bytes=budget_bytes)
        allocate = cache.allocate

        def counted(seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
            is_admission = cache.room(seq) == 0
            ok = allocate(seq, num_new_tokens, num_lookahead_tokens)
            if not ok and not num_lookahead_tokens:    # a draft lookahead refused is retried without it
                if is_admission:
                    self.coverage.admissions_refused += 1
                else:
                    self.coverage.growths_refused += 1
            elif ok and is_admission and seq.num_preemptions:
                self.coverage.resumed += 1
            return ok

        cache.allocate = counted

    def on_step_start(self, batch: Batch, at: float) -> None:
        c = self.coverage
        c.steps += 1
        emitting = [s for s, e in zip(batch.seqs, batch.emits) if e]
        for seq in emitting:
            params = seq.request.sampling
            c.temperatures.add(params.temperature)
            if not params.is_greedy:
                c.top_ps.add(params.top_p)
        if len({s.request.sampling.is_greedy for s in emitting}) == 2:
            c.mixed_batches += 1
        silent = [i for i, e in enumerate(batch.emits) if not e]
        if silent and any(batch.emits[silent[0] + 1:]):
            c.chunk_before_emitter += 1

    def on_step_end(self, batch: Batch, emitted: dict[int, list[int]], at: float) -> None:
        c = self.coverage
        c.peak_reserved_bytes = max(c.peak_reserved_bytes, self.cache.bytes_reserved())
