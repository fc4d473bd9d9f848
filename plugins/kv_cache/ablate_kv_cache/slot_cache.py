"""Shared by contiguous and dynamic: each sequence owns one row of a (slots, capacity) buffer.

Writes go through one flat index per step (slot * capacity + position, as nano-vllm's slot
mapping), so a step that mixes prefill chunks and decode tokens is one index_copy_ per layer.
Reads hand attention the batch's rows: a free view when their slots are consecutive.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ablate.api.step import StepInputs
from ablate.api.context import BuildContext
from ablate.api.slots import KVCache
from ablate.api.kv import PaddedKV
from ablate.api.sequence import Sequence
from ablate_kv_cache.budget import BudgetConfig, budget_bytes


@dataclass
class SlotCacheConfig(BudgetConfig):
    """The budget (bytes or a fraction of free memory) caps the slots x capacity buffer."""


class RowBuffers:
    """K/V in one row per sequence of (layers, slots, capacity, H_kv, D) buffers `k` and `v`: where
    a step's tokens are written, and the rows attention reads (shared by the slot caches and any
    cache laid out the same way, e.g. plugins/streaming)."""

    k: torch.Tensor
    v: torch.Tensor
    capacity: int

    def plan_rows(self, slots: list[int], step: StepInputs, shifts: list[int]) -> None:
        """Sequence i's tokens go to row slots[i] at index position - shifts[i]."""
        device = step.positions.device
        num_new = torch.tensor(step.query_lens, device=device)
        slot_t = torch.tensor(slots, device=device)
        shift_t = torch.tensor(shifts, device=device).repeat_interleave(num_new)              # (T,)
        self._write_index = slot_t.repeat_interleave(num_new) * self.capacity + step.positions - shift_t   # (T,)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        self._rows = slice(slots[0], slots[0] + len(slots)) if consecutive else slot_t

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> rows of the flattened (slots * capacity, H_kv, D) buffer; flatten, not
        # view(-1, ...): MLA's V has zero width, and -1 cannot be inferred from zero elements
        self.k[layer].flatten(0, 1).index_copy_(0, self._write_index, k)
        self.v[layer].flatten(0, 1).index_copy_(0, self._write_index, v)

    def view(self, layer: int, step: StepInputs) -> PaddedKV:
        return PaddedKV(self.k[layer][self._rows], self.v[layer][self._rows])   # (B, capacity, H_kv, D)


class SlotKVCache(RowBuffers, KVCache):
    stats_keys = ("kv_slots", "kv_capacity_tokens", "kv_peak_reserved_bytes", "max_seqs_admitted",
                  "kv_frag_slots_per_seq_mean")

    def __init__(self, config: SlotCacheConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.budget_bytes = budget_bytes(config, self.spec.device)   # 0: no limit beyond the slots
        self.max_seqs_admitted = 0               # most sequences holding a slot at once
        self.lengths_admitted: dict[int, tuple[int, int]] = {}   # seq_id -> (prompt, max output), for predictions
        self._frag_slots_per_seq: list[float] = []   # per step: row capacity not holding a token, per sequence
        self.slot_of: dict[int, int] = {}
        self.free_slots: list[int] = []          # a heap: the lowest free slot first keeps rows together
        self.k = self.v = torch.empty(0)
        self.peak_reserved = 0
        self._allocate(0, 0)

    # -- storage -----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _allocate(self, num_slots: int, capacity: int) -> None:
        """(Re)allocate to (layers, slots, capacity, H_kv, D), keeping what is stored."""
        s = self.spec
        new_k = torch.zeros(s.num_layers, num_slots, capacity, s.n_kv_heads, s.k_head_dim, dtype=s.dtype, device=s.device)
        new_v = torch.zeros(s.num_layers, num_slots, capacity, s.n_kv_heads, s.v_head_dim, dtype=s.dtype, device=s.device)
        old_slots, old_cap = (self.k.shape[1], self.k.shape[2]) if self.k.dim() == 5 else (0, 0)
        if old_slots and old_cap:
            new_k[:, :old_slots, :old_cap] = self.k
            new_v[:, :old_slots, :old_cap] = self.v
        self.free_slots = sorted(set(self.free_slots) | set(range(old_slots, num_slots)))
        self.k, self.v = new_k, new_v
        self.peak_reserved = max(self.peak_reserved, self.bytes_reserved())

    def bytes_reserved(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def bytes_per_slot(self, capacity: int) -> int:
        return capacity * self.spec.bytes_per_token

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        if not self.free_slots:
            raise RuntimeError(f"admit(seq {seq.seq_id}) without room: call can_admit first")
        self.slot_of[seq.seq_id] = heapq.heappop(self.free_slots)
        self.max_seqs_admitted = max(self.max_seqs_admitted, len(self.slot_of))
        self.lengths_admitted.setdefault(seq.seq_id, (seq.num_prompt_tokens, seq.request.max_new_tokens))

    def num_seqs_admitted(self) -> int:
        return len(self.slot_of)

    def release(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            heapq.heappush(self.free_slots, slot)
        self._lengths.pop(seq.seq_id, None)

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> None:
        super().prepare(step)
        self._frag_slots_per_seq.append(self.capacity - sum(step.context_lens) / len(step.context_lens))
        slots = [self.slot_of[s.seq_id] for s in step.seqs]
        self.plan_rows(slots, step, [0] * len(slots))

    def stats(self) -> dict[str, float]:
        return {"kv_slots": self.num_slots, "kv_capacity_tokens": self.capacity,
                "kv_peak_reserved_bytes": self.peak_reserved, "max_seqs_admitted": self.max_seqs_admitted,
                "kv_frag_slots_per_seq_mean": float(np.mean(self._frag_slots_per_seq)) if self._frag_slots_per_seq
                else float("nan")}
