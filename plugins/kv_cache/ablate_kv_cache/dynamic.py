"""kv_cache=dynamic: rows and their length grow as sequences and tokens arrive.

Growth doubles (amortised O(1) copies per token, unlike concatenating every step), so the cache
holds at most about twice what the longest live sequence needs, times the rows in use.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api import Sequence
from ablate_kv_cache.slot_cache import SlotCacheConfig, SlotKVCache


@dataclass
class DynamicConfig(SlotCacheConfig):
    name: str = "dynamic"
    initial_tokens: int = 64      # first row length; rows double from there

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.initial_tokens < 1:
            raise ValueError(f"kv_cache.initial_tokens must be >= 1, got {self.initial_tokens}")


def doubled(need: int, have: int, floor: int) -> int:
    """The first of max(have, floor) * 2^i that is >= need."""
    size = max(have, floor)
    while size < need:
        size *= 2
    return size


class DynamicKVCache(SlotKVCache):
    name = "dynamic"
    config_class = DynamicConfig

    def _fits(self, num_slots: int, capacity: int) -> bool:
        return not self.budget_bytes or num_slots * self.bytes_per_slot(capacity) <= self.budget_bytes

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        is_new = seq.seq_id not in self.slot_of
        if is_new and len(self.slot_of) >= self.spec.max_num_seqs:
            return False
        # grow by doubling (never past what the workload can use), or, when the budget forbids the
        # doubled size, by just what is needed
        slots_needed = self.num_slots + 1 if is_new and not self.free_slots else self.num_slots
        capacity_needed = max(self.capacity, num_tokens)
        doubled_size = (min(doubled(slots_needed, self.num_slots, 1), self.spec.max_num_seqs)
                        if slots_needed > self.num_slots else self.num_slots,
                        min(doubled(capacity_needed, self.capacity, self.config.initial_tokens), self.spec.max_seq_len)
                        if capacity_needed > self.capacity else self.capacity)
        if (slots_needed, capacity_needed) != (self.num_slots, self.capacity):
            size = next((size for size in (doubled_size, (slots_needed, capacity_needed)) if self._fits(*size)), None)
            if size is None:
                return False
            self._allocate(*size)
        if is_new:
            self.take_slot(seq)
        return True
