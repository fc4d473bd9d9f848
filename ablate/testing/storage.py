"""Does a KV cache report the memory it holds? Checked at the end of every step of a kit run.

The rules, with committed(s) the tokens the engine committed for sequence s, and storage the bytes
of every tensor the cache object holds:

    bytes_used() <= bytes_reserved() <= storage, and <= kv_cache.budget_bytes when one is set
    exact caches (they keep every token): bytes_used() == sum_s committed(s) x bytes_per_token
                                          and that many bytes fit in storage
    others:                               bytes_used() <= sum_s committed(s) x bytes_per_token
    the first step of a fresh cache:      the bytes of storage it turns nonzero <= what it wrote x
                                          bytes_per_token x STORED_SLACK

The last rule bounds bytes_per_token from below by what the cache actually stores (the others bound
it from above only, so a cache reporting 0, or half its bytes, passed every one): K/V written into
fresh storage are nonzero bytes, and the first step of a fresh cache writes at most its new tokens
and the drafts it may verify. Storage allocated uninitialised (torch.empty) can only make the count
smaller: the rule never fails a cache for it.
"""
from __future__ import annotations

import torch

from ablate.api.kv import KVBudgetConfig
from ablate.api.kv_cache import KVCache
from ablate.api.step import Batch
from ablate.engine.hooks import StepHook

# headroom over what the first step wrote: tensors a cache keeps besides K/V (a block table on the
# device, say) that the step also fills; a cache reporting half its bytes per token stores 2x
STORED_SLACK = 1.25


def held_storages(obj: object, depth: int = 3) -> dict[int, torch.UntypedStorage]:
    """The distinct tensor storages reachable from `obj`'s attributes (and their containers), by address."""
    seen: dict[int, torch.UntypedStorage] = {}

    def visit(value: object, level: int) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.nbytes() > seen.get(storage.data_ptr(), torch.UntypedStorage()).nbytes():
                seen[storage.data_ptr()] = storage
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
    return seen


def held_storage_bytes(obj: object) -> int:
    return sum(s.nbytes() for s in held_storages(obj).values())


def nonzero_bytes(obj: object) -> int:
    """Bytes that are not 0 in the storages `obj` holds."""
    total = 0
    for storage in held_storages(obj).values():
        as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        total += int(as_bytes.count_nonzero())
    return total


class StorageCheck(StepHook):
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.problems: list[str] = []
        self.max_used = 0
        config = cache.config            # an explicit budget in bytes bounds what it may reserve
        self.budget = config.budget_bytes if isinstance(config, KVBudgetConfig) else 0
        self.first_step: tuple[int, int] | None = None    # (nonzero bytes before it, tokens it may write)
        self.steps = 0

    def on_step_start(self, batch: Batch, at: float) -> None:
        self.steps += 1
        if self.steps == 1 and self.cache.keeps_kv:
            self.first_step = (nonzero_bytes(self.cache), batch.num_tokens + sum(batch.num_lookahead_tokens))

    def on_step_end(self, batch: Batch, emitted: dict[int, list[int]], at: float) -> None:
        if self.problems:
            return
        if self.steps == 1 and self.first_step is not None:
            self.check_stored_bytes(*self.first_step)
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

    def check_stored_bytes(self, nonzero_before: int, tokens_written: int) -> None:
        stored = nonzero_bytes(self.cache) - nonzero_before
        claimed = tokens_written * self.cache.bytes_per_token
        if stored > STORED_SLACK * claimed:
            self.problems.append(
                f"its first step wrote at most {tokens_written} tokens and turned {stored} bytes of its storage "
                f"nonzero, {stored / max(tokens_written, 1):.0f} per token, but bytes_per_token is "
                f"{self.cache.bytes_per_token}: it must count every byte stored per token (results, budgets and "
                "memory figures use it)")
