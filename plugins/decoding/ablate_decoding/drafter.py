"""What every drafter offers the speculative decoder: proposals for the batch's decoding sequences."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ablate.api import Sequence


class Drafter(ABC):
    name: str = ""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to num_drafts[i] draft tokens to follow seqs[i], and the distributions they were drawn
        from, (len(tokens), V) per sequence, or None where they are deterministic (q = one-hot)."""

    def num_passes(self) -> int:
        """Forward passes run so far (a model drafter's; 0 for a lookup)."""
        return 0

    def bytes_reserved(self) -> int:
        """Bytes of K/V the drafter holds (its own cache)."""
        return 0

    def close(self) -> None:
        """Free what the drafter holds."""
