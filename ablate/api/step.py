"""One engine step's work: which sequences, how many new tokens each, and the tensors for it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ablate.api.sequence import Sequence


@dataclass
class Batch:
    """The scheduler's decision for one step."""

    seqs: list[Sequence]
    num_new_tokens: list[int]          # tokens each sequence feeds this step (prompt chunk, 1 for decode)

    def __post_init__(self) -> None:
        if len(self.seqs) != len(self.num_new_tokens):
            raise ValueError("Batch needs one num_new_tokens entry per sequence")

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class StepInputs:
    """The tensors of one forward pass, built once per step and read by every layer.

    Queries are packed: sequence b owns rows query_starts[b] : query_starts[b+1] of every (T, ...)
    tensor. Its queries sit at absolute positions context_lens[b] - query_lens[b] ... context_lens[b]-1,
    and after this step's K/V are written the cache holds context_lens[b] keys for it.
    """

    seqs: list[Sequence]
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    query_lens: list[int]          # (B,) tokens fed per sequence
    context_lens: list[int]        # (B,) keys per sequence after this step
    query_starts: list[int]        # (B+1,) cumulative starts of each sequence's queries
    logits_indices: torch.Tensor   # (N,) rows of the packed hidden states that need logits
    context_lens_t: torch.Tensor   # (B,) int32 on the device, for kernels and masks
    query_starts_t: torch.Tensor   # (B+1,) int32 on the device
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token: the batched fast paths apply."""
        return self.max_query_len == 1

    def memo(self, key: str, make):
        """A value derived from this step's shapes, computed by the first layer and reused by the rest."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def query_pad_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter packed queries into (B, max_query_len): returns (packed row -> padded row, valid mask)."""
        def make():
            device = self.input_ids.device
            lens = torch.tensor(self.query_lens, device=device)                       # (B,)
            col = torch.arange(self.max_query_len, device=device)                    # (Lq,)
            valid = col[None, :] < lens[:, None]                                      # (B, Lq)
            return valid.flatten().nonzero().squeeze(1), valid
        return self.memo("query_pad_index", make)
