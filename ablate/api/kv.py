"""What attention reads from a KV cache for one layer, in the cache's own layout.

Every view can also hand out the keys and values padded per sequence, (B, S, H_kv, D) with
S = the batch's longest context, which is what the generic attention paths (naive, sdpa) use.
Kernels that understand a layout natively (paged decode) take the view as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api.step import StepInputs


@dataclass
class PackedKV:
    """This step's keys and values only, packed like the queries (the `none` cache: no history)."""

    k: torch.Tensor   # (T, H_kv, D)
    v: torch.Tensor   # (T, H_kv, D)

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _ = step.query_pad_index()
        b, s = step.num_seqs, step.max_query_len
        k = self.k.new_zeros(b * s, *self.k.shape[1:]).index_copy_(0, rows, self.k)
        v = self.v.new_zeros(b * s, *self.v.shape[1:]).index_copy_(0, rows, self.v)
        return k.view(b, s, *self.k.shape[1:]), v.view(b, s, *self.v.shape[1:])   # (B, S, H_kv, D)


@dataclass
class PaddedKV:
    """One row per sequence, already padded (contiguous and dynamic caches)."""

    k: torch.Tensor   # (B, S, H_kv, D), S >= the longest context
    v: torch.Tensor

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        s = step.max_context_len
        return self.k[:, :s], self.v[:, :s]


@dataclass
class PagedKV:
    """A pool of fixed-size blocks and, per sequence, the table of blocks it owns (paged cache)."""

    k_cache: torch.Tensor        # (num_blocks, block_size, H_kv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # (B, max_blocks_per_seq) int32, physical block of each logical block

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        s = step.max_context_len
        num_blocks = -(-s // self.block_size)
        table = self.block_tables[:, :num_blocks].long()                  # (B, nb)
        k = self.k_cache[table].flatten(1, 2)[:, :s]                       # (B, S, H_kv, D)
        v = self.v_cache[table].flatten(1, 2)[:, :s]
        return k, v


KVView = PackedKV | PaddedKV | PagedKV
