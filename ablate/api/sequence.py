"""What a user asks for (Request) and the engine's state for it (Sequence)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 -> greedy (argmax)
    top_p: float = 1.0           # nucleus: keep the smallest set of tokens whose probability mass >= top_p
    seed: int | None = None      # per-request generator seed: the same seed gives the same tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

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
    arrival_time: float = 0.0    # seconds after the workload starts

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id}: arrival_time must be >= 0, got {self.arrival_time}")


class Status(enum.Enum):
    WAITING = "waiting"      # arrived, not admitted (or preempted)
    RUNNING = "running"      # holds KV-cache room and is being computed
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in flight: its tokens so far and how many of them the KV cache holds."""

    request: Request
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens already run through the model (a cache that keeps K/V holds them)
    status: Status = Status.WAITING
    finish_reason: str | None = None     # "length" | "stop"
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def seq_id(self) -> int:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_num_tokens(self) -> int:
        """The longest this sequence can become: what a contiguous cache reserves."""
        return self.num_prompt_tokens + self.request.max_new_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while prompt tokens remain to be computed (the first step, or chunks of it)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_ids: list[int]) -> list[int]:
        """Append emitted tokens, stopping at the stop token or the length limit; returns those kept."""
        kept: list[int] = []
        for token in token_ids:
            if self.num_output_tokens >= self.request.max_new_tokens:
                break
            self.token_ids.append(token)
            kept.append(token)
            if token in self.request.stop_token_ids:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and self.num_output_tokens >= self.request.max_new_tokens:
            self.finish_reason = "length"
        return kept
