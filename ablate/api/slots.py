"""The engine interface: one abstract class per slot.

Designed for every technique from the start: a batch holds many sequences of different lengths,
sequences join and leave every step, a step may mix prefill chunks with decode tokens, and KV can
be rolled back (speculative decoding rejects tokens).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ablate.api.step import Batch, StepInputs
from ablate.api.kv import KVView
from ablate.api.plugin import Plugin, PluginConfig, Slot
from ablate.api.sequence import Sequence

if TYPE_CHECKING:
    from ablate.api.context import BuildContext, KVSpec
    from ablate.model.llama import LlamaModel
    from ablate.engine.runner import ModelRunner


class KVCache(Plugin):
    """Holds each running sequence's keys and values. Policy (room) and storage in one place."""

    slot = Slot.KV_CACHE
    keeps_kv: ClassVar[bool] = True   # False: nothing is kept, the runner feeds the whole prefix

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.spec: KVSpec = ctx.kv_spec
        self._lengths: dict[int, int] = {}   # tokens held per live sequence (seq_id -> length)

    @abstractmethod
    def can_admit(self, seq: Sequence) -> bool:
        """Is there room to start this sequence now?"""

    @abstractmethod
    def admit(self, seq: Sequence) -> None:
        """Reserve room: the maximum length (contiguous) or the prompt's blocks (paged)."""

    @abstractmethod
    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` more tokens of `seq`; False: no room (the scheduler preempts)."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: free its room."""

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back to the first `num_tokens` tokens (speculative decoding rejected the rest)."""
        self._lengths[seq.seq_id] = num_tokens

    def prepare(self, step: StepInputs) -> None:
        """Called once per step before the forward pass: map this step's tokens to storage."""
        for seq, length in zip(step.seqs, step.context_lens):
            self._lengths[seq.seq_id] = length

    @abstractmethod
    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's new keys and values, k and v (T, H_kv, D), at their positions."""

    @abstractmethod
    def view(self, layer: int, step: StepInputs) -> KVView:
        """What attention reads for this layer: every sequence's keys, this step's included."""

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes the cache holds now (allocated for K/V)."""

    def bytes_used(self) -> int:
        """Live tokens x bytes per token."""
        return sum(self._lengths.values()) * self.spec.bytes_per_token

    def num_seqs_admitted(self) -> int:
        """Sequences holding room now (admitted, not yet released): what a budget limits."""
        return len(self._lengths)


class Attention(Plugin):
    """softmax(q k^T / sqrt(D) + causal mask) v for every sequence of the step."""

    slot = Slot.ATTENTION

    @property
    def backend(self) -> str:
        """The implementation that actually ran (recorded with the results)."""
        return self.name

    @abstractmethod
    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        """q (T, H, D) packed queries -> (T, H, D)."""


class Scheduler(Plugin):
    """Which sequences run each step, and how many tokens each feeds."""

    slot = Slot.SCHEDULER

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """A request arrived."""

    @abstractmethod
    def next_batch(self) -> Batch | None:
        """This step's work; None when nothing can run now."""

    @abstractmethod
    def finish_step(self, batch: Batch, emitted: dict[int, list[int]]) -> list[Sequence]:
        """Retire finished sequences, release their room; returns the ones that finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...


class Decoding(Plugin):
    """How tokens are picked once the model has run: one per step, or several (speculative)."""

    slot = Slot.DECODING

    @abstractmethod
    def step(self, runner: ModelRunner, batch: Batch) -> dict[int, list[int]]:
        """Run the batch; returns the tokens each sequence emits this step (seq_id -> tokens)."""


class ModelVariant(Plugin):
    """Changes the loaded model (fewer KV heads, latent KV) before the engine runs it."""

    slot = Slot.MODEL

    @abstractmethod
    def apply(self, model: LlamaModel) -> LlamaModel: ...
