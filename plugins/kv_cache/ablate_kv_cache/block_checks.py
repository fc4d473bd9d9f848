"""The invariants of the block manager's bookkeeping (block_manager.py), checked by the tests after every step."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ablate_kv_cache.block_manager import BlockManager

NULL_BLOCK = -1     # a table entry whose block was freed (before a sliding window): nothing to read there


def check_invariants(manager: BlockManager) -> None:
    """Raise AssertionError if `manager`'s bookkeeping is inconsistent."""
    holders: dict[int, int] = {}
    for seq_id, table in manager.block_tables.items():
        assert len(table) == manager.num_blocks_for(manager.num_tokens[seq_id]), f"seq {seq_id}: table length"
        held = [b for b in table if b != NULL_BLOCK]
        assert len(set(held)) == len(held), f"seq {seq_id}: a block twice in one table"
        for block_id in held:
            holders[block_id] = holders.get(block_id, 0) + 1
    assert holders == manager.ref_counts, "ref counts differ from the holders"
    released, cached, registered = set(manager._released), set(manager._cached_free), set(manager.registrations)
    assert len(released) + manager.num_blocks - manager._next_unused + len(cached) == manager.num_free_blocks \
        and len(released) == len(manager._released) and not released & cached, "free list: a block missing or twice"
    assert not (released | cached) & set(holders), "a held block is on the free list"
    assert all(0 <= b < manager._next_unused for b in [*released, *cached, *holders]), "a block out of range"
    assert not released & registered and cached <= registered, "free list: registered blocks out of place"
    for h, block_id in manager.cached_block_ids.items():
        assert block_id in manager.registrations and manager.registrations[block_id].hash == h, \
            f"block {block_id}: stale cache entry"
