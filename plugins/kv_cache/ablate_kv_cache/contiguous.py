"""kv_cache=contiguous: every sequence gets a row as long as the longest sequence, up front.

Nothing is allocated while decoding, and a row's K/V is one dense block (the fast read); the price
is memory reserved for tokens that may never come.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api.context import BuildContext
from ablate_kv_cache.paging_model import predict
from ablate.api.sequence import Sequence
from ablate_kv_cache.slot_cache import SlotCacheConfig, SlotKVCache


@dataclass
class ContiguousConfig(SlotCacheConfig):
    name: str = "contiguous"


class ContiguousKVCache(SlotKVCache):
    name = "contiguous"
    config_class = ContiguousConfig
    stats_keys = SlotKVCache.stats_keys + ("predicted_kv_util", "predicted_seqs_admitted",
                                           "predicted_frag_slots_per_seq")

    def __init__(self, config: ContiguousConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        capacity = self.spec.max_seq_len
        num_slots = self.spec.max_num_seqs
        if self.budget_bytes:
            num_slots = min(num_slots, self.budget_bytes // self.bytes_per_slot(capacity))
            if num_slots == 0:
                raise ValueError(
                    f"the KV budget of {self.budget_bytes} bytes holds no sequence of {capacity} tokens "
                    f"({self.bytes_per_slot(capacity)} bytes each)"
                )
        self._allocate(num_slots, capacity)

    def can_admit(self, seq: Sequence) -> bool:
        return bool(self.free_slots) and seq.max_num_tokens <= self.capacity

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        return seq.num_computed_tokens + num_tokens <= self.capacity

    def stats(self) -> dict[str, float]:
        # the paging model with one block of the full capacity per sequence (ablate/paging_model.py)
        prompts, outputs = zip(*self.lengths_admitted.values()) if self.lengths_admitted else ((), ())
        return super().stats() | predict(prompts, outputs, self.capacity, self.num_slots * self.capacity,
                                         self.num_slots)
