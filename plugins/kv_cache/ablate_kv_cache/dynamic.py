"""kv_cache=dynamic: rows and their length grow as sequences and tokens arrive.

Growth doubles (amortised O(1) copies per token, unlike concatenating every step), so the cache
holds at most about twice what the longest live sequence needs, times the rows in use.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api.step import StepInputs
from ablate.api.sequence import Sequence
from ablate_kv_cache.slot_cache import SlotCacheConfig, SlotKVCache


@dataclass
class DynamicConfig(SlotCacheConfig):
    name: str = "dynamic"
    initial_tokens: int = 64      # first row length; rows double from there

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.initial_tokens < 1:
            raise ValueError(f"kv_cache.initial_tokens must be >= 1, got {self.initial_tokens}")


class DynamicKVCache(SlotKVCache):
    name = "dynamic"
    config_class = DynamicConfig

    def _fits(self, num_slots: int, capacity: int) -> bool:
        budget = self.budget_bytes
        return not budget or num_slots * self.bytes_per_slot(capacity) <= budget

    def _grown(self, need: int, have: int, floor: int) -> int:
        size = max(have, floor)
        while size < need:
            size *= 2
        return size

    def can_admit(self, seq: Sequence) -> bool:
        if len(self.slot_of) >= self.spec.max_num_seqs:
            return False
        if self.free_slots:
            return True
        return self._fits(self._grown(self.num_slots + 1, self.num_slots, 1), max(self.capacity, 1))

    def admit(self, seq: Sequence) -> None:
        if not self.free_slots:
            self._allocate(self._grown(self.num_slots + 1, self.num_slots, 1), self.capacity)
        super().admit(seq)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = seq.num_computed_tokens + num_tokens
        if need <= self.capacity:
            return True
        capacity = self._grown(need, self.capacity, self.config.initial_tokens)
        if not self._fits(self.num_slots, capacity):
            return False
        self._allocate(self.num_slots, capacity)
        return True

    def prepare(self, step: StepInputs) -> None:
        need = max(step.context_lens)       # extra (draft) tokens may exceed what grow() was told
        if need > self.capacity:
            self._allocate(self.num_slots, self._grown(need, self.capacity, self.config.initial_tokens))
        super().prepare(step)
