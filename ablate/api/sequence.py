"""What a user asks for (Request) and the engine's state for it (Sequence).

Plugins read a Sequence; only the engine core changes it, in three places:
  - the scheduler base class (ablate.api.slots.Scheduler): admission (`start`) and preemption;
  - the engine, once after every step: the tokens it computed and emitted (`advance`);
  - a model session (a draft model's own run), for the shadow sequences it keeps.
Progress is therefore read-only from outside: `seq.num_computed_tokens = 3` raises AttributeError.
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 -> greedy (argmax)
    top_p: float = 1.0           # nucleus: keep the smallest set of tokens whose probability mass >= top_p
    seed: int | None = None      # per-request generator seed: the same seed gives the same tokens

    def __post_init__(self) -> None:
        if not (_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):     # NaN fails the comparison too
            raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or self.seed < 0):
            raise ValueError(f"seed must be a whole number >= 0, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0    # seconds after the workload starts; with `follows`: after that request finishes
    # closed loop (a user who waits for each reply): the id of the request that must finish before
    # this one is sent; its arrival_time is then the think time after that finish, and the engine
    # records the moment it was sent as its arrival (ablate.workload.arrivals.ArrivalQueue)
    follows: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        follows = self.follows
        if follows is not None and (isinstance(follows, bool) or not isinstance(follows, numbers.Integral)
                                    or follows == self.request_id):
            raise ValueError(f"request {self.request_id}: follows must be the id of another request (or None), "
                             f"got {self.follows!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"request {self.request_id}: arrival_time must be a finite number of seconds >= 0, "
                             f"got {self.arrival_time}")


class Status(enum.Enum):
    WAITING = "waiting"      # arrived, not admitted (or preempted)
    RUNNING = "running"      # holds KV-cache room and is being computed
    FINISHED = "finished"    # emitted its last token (a static batch may still hold its room)


class Sequence:
    """A request in flight: its tokens so far and how many of them have been run through the model."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._token_ids = list(request.prompt_token_ids)
        self._num_computed_tokens = 0
        self._status = Status.WAITING
        self._finish_reason: str | None = None
        self._num_preemptions = 0

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

    # -- read by everyone --------------------------------------------------------------------------
    @property
    def seq_id(self) -> int:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output so far. The engine's own list: read it, never change it."""
        return self._token_ids

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens already run through the model (a cache that keeps K/V holds them)."""
        return self._num_computed_tokens

    @property
    def status(self) -> Status:
        return self._status

    @property
    def finish_reason(self) -> str | None:
        """"length" (max_new_tokens reached) | "stop" (a stop token) | None while running."""
        return self._finish_reason

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self.num_prompt_tokens:]

    @property
    def max_num_tokens(self) -> int:
        """The longest this sequence can become: what a contiguous cache reserves. Its cache never
        holds more than max_num_tokens - 1 tokens: the last emitted token is never fed back."""
        return self.num_prompt_tokens + self.request.max_new_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while prompt tokens remain to be computed (the first step, or chunks of it)."""
        return self._num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self._status is Status.FINISHED

    # -- written by the engine core only ----------------------------------------------------------
    def start(self, num_cached_tokens: int = 0) -> None:
        """Scheduler base class: admitted; the cache already holds its first `num_cached_tokens`."""
        if self._status is not Status.WAITING:
            raise RuntimeError(f"sequence {self.seq_id} admitted while {self._status.value}")
        if not 0 <= num_cached_tokens < self.num_tokens:
            raise RuntimeError(f"sequence {self.seq_id}: {num_cached_tokens} cached tokens of {self.num_tokens}: "
                               "at least its last token must be fed (its logits pick the next)")
        self._status = Status.RUNNING
        self._num_computed_tokens = num_cached_tokens

    def requeue(self) -> None:
        """Scheduler base class: an admission found no room after all; waiting again, nothing computed."""
        self._status = Status.WAITING
        self._num_computed_tokens = 0

    def preempt(self) -> None:
        """Scheduler base class: back to the queue with nothing computed (its K/V is recomputed)."""
        self.requeue()
        self._num_preemptions += 1

    def sync(self, token_ids: list[int], num_computed: int) -> None:
        """A model session's shadow of a target sequence (ablate/engine/session.py): it now knows
        `token_ids` (the list itself, not a copy) and its own cache holds the first `num_computed`."""
        if not 0 <= num_computed <= len(token_ids):
            raise RuntimeError(f"sequence {self.seq_id}: {num_computed} computed of {len(token_ids)} tokens")
        self._token_ids = token_ids
        self._num_computed_tokens = num_computed

    def advance(self, num_new_tokens: int, emitted: list[int]) -> list[int]:
        """Engine, after a step that fed `num_new_tokens` (+ the drafts it verified) and emitted `emitted`.

        Appends the emitted tokens up to a stop token or the length limit and returns those kept.
        Computed afterwards: without emissions, the fed tokens; with them, every token but the
        last kept one (the accepted drafts were fed; the last token is fed next step).
        """
        if not emitted:
            self._num_computed_tokens += num_new_tokens
            return []
        kept: list[int] = []
        for token in emitted:
            if self.num_output_tokens >= self.request.max_new_tokens:
                break
            self._token_ids.append(token)
            kept.append(token)
            if token in self.request.stop_token_ids:
                self._finish_reason = "stop"
                break
        if self._finish_reason is None and self.num_output_tokens >= self.request.max_new_tokens:
            self._finish_reason = "length"
        self._num_computed_tokens = self.num_tokens - 1
        if self._finish_reason is not None:
            self._status = Status.FINISHED
        return kept
