"""What every drafter offers the speculative decoder: proposals, and forgetting rejected ones."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ablate.api.sequence import Sequence
from ablate.engine.runner import ModelRunner


class Drafter(ABC):
    name: str = ""

    def prepare(self, target: ModelRunner) -> None:
        """Called at the start of every step with the target's runner (a model drafter runs its
        passes through the same attention plugin)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to num_drafts[i] draft tokens to follow seqs[i], and the distributions they were drawn
        from, (len(tokens), V) per sequence, or None where they are deterministic (q = one-hot)."""

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Only the first `num_tokens` tokens of seq are final: forget anything computed after them."""

    def num_passes(self) -> int:
        """Forward passes run so far (a model drafter's; 0 for a lookup)."""
        return 0

    def bytes_reserved(self) -> int:
        """Bytes of K/V the drafter holds (its own cache)."""
        return 0

    def close(self) -> None:
        """Free what the drafter holds."""
