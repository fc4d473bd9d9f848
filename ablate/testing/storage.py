"""Does a KV cache report the memory it holds? Checked at the end of every step of a kit run.

The rules, with committed(s) the tokens the engine committed for sequence s, and storage the bytes
of every tensor the cache object holds:

    bytes_used() <= bytes_reserved() <= storage, and <= kv_cache.budget_bytes when one is set
    exact caches (they keep every token): bytes_used() == sum_s committed(s) x bytes_per_token
                                          and that many bytes fit in storage
    others:                               bytes_used() <= sum_s committed(s) x bytes_per_token
"""
from __future__ import annotations

import torch

from ablate.api.kv import KVBudgetConfig
from ablate.api.kv_cache import KVCache
from ablate.api.step import Batch
from ablate.measure.recorder import StepHook


def held_storage_bytes(obj: object, depth: int = 3) -> int:
    """Bytes of the distinct tensor storages reachable from `obj`'s attributes (and their containers)."""
    seen: dict[int, int] = {}

    def visit(value: object, level: int) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        elif level > 0 and isinstance(value, (list, tuple, set)):
            for item in value:
                visit(item, level - 1)
        elif level > 0 and isinstance(value, dict):
            for item in value.values():
                visit(item, level - 1)
        elif level > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            for item in vars(value).values():
                visit(item, level - 1)

    for item in vars(obj).values():
        visit(item, depth)
    return sum(seen.values())


class StorageCheck(StepHook):
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.problems: list[str] = []
        self.max_used = 0
        config = cache.config            # an explicit budget in bytes bounds what it may reserve
        self.budget = config.budget_bytes if isinstance(config, KVBudgetConfig) else 0

    def on_step_end(self, batch: Batch, emitted: dict[int, list[int]], at: float) -> None:
        if self.problems:
            return
        cache = self.cache
        used, reserved = cache.bytes_used(), cache.bytes_reserved()
        storage = held_storage_bytes(cache)
        committed = sum(cache.num_committed().values()) * cache.bytes_per_token
        self.max_used = max(self.max_used, used)
        if not cache.keeps_kv:
            if used or reserved:
                self.problems.append(f"keeps no K/V (keeps_kv = False) but reports {used} bytes used, "
                                     f"{reserved} reserved")
        elif used > reserved:
            self.problems.append(f"bytes_used() {used} exceeds bytes_reserved() {reserved}")
        elif reserved > storage:
            self.problems.append(f"bytes_reserved() {reserved} exceeds the {storage} bytes of tensors it holds")
        elif self.budget and reserved > self.budget:
            self.problems.append(f"bytes_reserved() {reserved} exceeds kv_cache.budget_bytes={self.budget}")
        elif type(cache).exact and used != committed:
            self.problems.append(f"bytes_used() {used} differs from the committed tokens x bytes_per_token = "
                                 f"{committed} (an exact cache keeps every committed token)")
        elif type(cache).exact and committed > storage:
            self.problems.append(f"the committed tokens x bytes_per_token = {committed} bytes do not fit the "
                                 f"{storage} bytes of tensors it holds: bytes_per_token is too large")
        elif used > committed:
            self.problems.append(f"bytes_used() {used} exceeds the committed tokens x bytes_per_token = {committed}")
