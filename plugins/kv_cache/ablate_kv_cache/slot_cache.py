"""Shared by contiguous and dynamic: each sequence owns one row (slot) of a dense buffer.

Writes go through one flat index per step (slot * capacity + position, as nano-vllm's slot
mapping), so a step that mixes prefill chunks and decode tokens is one index_copy_ per layer.
Reads hand attention the batch's rows: a free view when their slots are consecutive.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ablate.api import (BuildContext, KVBudgetConfig, KVCache, KVSpec, RowBuffers, Sequence, Stat, StepInputs,
                        budget_bytes, free_memory_bytes)


def check_pool_fits(cache: str, pool_bytes: int, seq_bytes: int, spec: KVSpec, config: KVBudgetConfig,
                    budget: int) -> None:
    """Before a cache allocates its pool (`seq_bytes` per sequence of spec.max_seq_len tokens; `budget`:
    the config's budget in bytes, 0: none): a ValueError naming the options to change if the pool
    exceeds the memory free on the device."""
    free = free_memory_bytes(spec.device)
    if pool_bytes <= free:
        return
    where = f"on {spec.device}" if spec.device.type == "cuda" else "in RAM"
    fit = free // seq_bytes
    if budget and pool_bytes < spec.max_num_seqs * seq_bytes:     # the budget, not max_num_seqs, sized it
        option = (f"kv_cache.budget_fraction={config.budget_fraction} ({budget} bytes)" if config.budget_fraction
                  else f"kv_cache.budget_bytes={budget}")
        raise ValueError(
            f"kv_cache={cache}: the KV budget {option} makes a pool of {pool_bytes} bytes, more than the "
            f"{free} bytes free {where}: lower the budget below {free} bytes (kv_cache.budget_bytes, or "
            f"kv_cache.budget_fraction: a share of the free memory)")
    raise ValueError(
        f"kv_cache={cache}: the KV pool for engine.max_num_seqs={spec.max_num_seqs} sequences of "
        f"{spec.max_seq_len} tokens (engine.max_seq_len, or the workload's longest prompt + output) at "
        f"{spec.bytes_per_token} bytes per token needs {pool_bytes} bytes, more than the {free} bytes free {where}. "
        + (f"{fit} such sequences fit: lower engine.max_num_seqs to {fit} or below, " if fit else
           "Not even one such sequence fits: ")
        + "shorten the sequences (engine.max_seq_len, the workload's lengths), or cap the pool with "
          "kv_cache.budget_bytes or kv_cache.budget_fraction (a share of the free memory, e.g. 0.9)")


@dataclass
class SlotCacheConfig(KVBudgetConfig):
    """The budget (bytes or a fraction of free memory) caps the slots x capacity buffer."""


class SlotKVCache(RowBuffers, KVCache):
    graph_safe = True     # the plan (write index, rows, storage) is all in step.plan (ablate/api/rows.py)
    reported_stats = (
        Stat("kv_slots", "rows of the buffer (sequences it can hold)", "count"),
        Stat("kv_capacity_tokens", "tokens per row", "tokens"),
        Stat("kv_peak_reserved_bytes", "largest buffer held", "bytes"),
        Stat("max_seqs_admitted", "most sequences holding a row at once", "count"),
        Stat("kv_frag_slots_per_seq_mean", "row capacity holding no token, per sequence and step (mean)", "tokens",
             table="KV cache"),
    )

    def __init__(self, config: SlotCacheConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.budget_bytes = budget_bytes(config, self.spec.device, self.spec.bytes_per_token)   # 0: no limit beyond the slots
        self.max_seqs_admitted = 0               # most sequences holding a slot at once
        self.lengths_admitted: dict[int, tuple[int, int]] = {}   # seq_id -> (prompt, max output), for predictions
        self._frag_slots_per_seq: list[float] = []   # per step: row capacity not holding a token, per sequence
        self.slot_of: dict[int, int] = {}
        self.free_slots: list[int] = []          # a heap: the lowest free slot first keeps rows together
        self.k = self.v = torch.empty(0, device=self.spec.device)
        self.peak_reserved = 0
        self._allocate(0, 0)

    # -- storage -----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

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

    # -- room --------------------------------------------------------------------------------------
    def take_slot(self, seq: Sequence) -> None:
        self.slot_of[seq.seq_id] = heapq.heappop(self.free_slots)
        self.max_seqs_admitted = max(self.max_seqs_admitted, len(self.slot_of))
        self.lengths_admitted.setdefault(seq.seq_id, (seq.num_prompt_tokens, seq.request.max_new_tokens))

    def num_seqs_admitted(self) -> int:
        return len(self.slot_of)

    def free(self, seq: Sequence) -> None:
        heapq.heappush(self.free_slots, self.slot_of.pop(seq.seq_id))

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> None:
        self._frag_slots_per_seq.append(self.capacity - sum(step.context_lens) / len(step.context_lens))
        slots = [self.slot_of[s.seq_id] for s in step.seqs]
        self.plan_rows(slots, step, [0] * len(slots))

    def stats(self) -> dict[str, float]:
        return {"kv_slots": self.num_slots, "kv_capacity_tokens": self.capacity,
                "kv_peak_reserved_bytes": self.peak_reserved, "max_seqs_admitted": self.max_seqs_admitted,
                "kv_frag_slots_per_seq_mean": float(np.mean(self._frag_slots_per_seq)) if self._frag_slots_per_seq
                else float("nan")}
