"""kv_cache=contiguous: every sequence gets a row as long as the longest sequence, up front.

Nothing is allocated while decoding, and a row's K/V is one dense block (the fast read); the price
is memory reserved for tokens that may never come.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api import BuildContext, Sequence
from ablate_kv_cache.paging_model import PREDICTION_STATS, predict
from ablate_kv_cache.slot_cache import SlotCacheConfig, SlotKVCache, check_pool_fits


@dataclass
class ContiguousConfig(SlotCacheConfig):
    name: str = "contiguous"


class ContiguousKVCache(SlotKVCache):
    name = "contiguous"
    config_class = ContiguousConfig
    reported_stats = SlotKVCache.reported_stats + PREDICTION_STATS

    def __init__(self, config: ContiguousConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        capacity = self.spec.max_seq_len
        num_slots = self.spec.max_num_seqs
        if self.budget_bytes:
            num_slots = min(num_slots, self.budget_bytes // self.bytes_per_slot(capacity))
            if num_slots == 0:
                raise ValueError(
                    f"kv_cache=contiguous: the KV budget of {self.budget_bytes} bytes holds no sequence of {capacity} "
                    f"tokens ({self.bytes_per_slot(capacity)} bytes each): raise kv_cache.budget_bytes")
        # before allocating: a pool larger than the free memory fails with a clear message, not torch's
        check_pool_fits(self.name, num_slots * self.bytes_per_slot(capacity), self.bytes_per_slot(capacity),
                        self.spec, config, self.budget_bytes)
        self._allocate(num_slots, capacity)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.seq_id in self.slot_of:
            return num_tokens <= self.capacity
        if not self.free_slots or seq.max_num_tokens - 1 > self.capacity:
            return False
        self.take_slot(seq)
        return True

    def stats(self) -> dict[str, float]:
        # the paging model with one block of the full capacity per sequence (paging_model.py)
        prompts, outputs = zip(*self.lengths_admitted.values()) if self.lengths_admitted else ((), ())
        return super().stats() | predict(prompts, outputs, self.capacity, self.num_slots * self.capacity,
                                         self.num_slots)
