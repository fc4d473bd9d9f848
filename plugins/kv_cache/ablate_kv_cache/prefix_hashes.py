"""How prefix caching names a full block (block_manager.py): a chained hash, verified against what it holds."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

HashFn = Callable[[int | None, tuple[int, ...]], int]


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """h_i = hash((h_{i-1}, tokens_i)); Python hashes tuples of ints deterministically."""
    return hash((prev_hash, token_ids))


@dataclass(frozen=True)
class Registration:
    """What a registered full block holds: a prefix-cache hit is verified against it."""
    hash: int                          # chained hash of the prefix the block ends
    token_ids: tuple[int, ...]         # its tokens
    content_id: int                    # unique per registration, never reused
    parent_content_id: int             # content_id of the block before it in its sequence (0: first)
