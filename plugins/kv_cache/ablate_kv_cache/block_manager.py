"""The block manager: which physical KV blocks each sequence owns. Bookkeeping only, no tensors.

The pool holds `num_blocks` blocks of `block_size` token slots. A sequence's block table lists its
blocks in logical order: token p lives in slot p % block_size of block table[p // block_size], so a
sequence holds ceil(tokens / block_size) blocks and wastes at most block_size - 1 slots (its last
block's tail) instead of everything up to the maximum length.

Blocks are reference-counted so that several sequences can hold one:
- `fork` gives a child all of its parent's blocks (parallel sampling, beam search);
- with prefix caching, a sequence whose prompt starts with the same full blocks as one computed
  before takes those blocks instead of recomputing their K/V. A full block is named by the chained
  hash h_i = hash((h_{i-1}, tokens of block i)), so equal hashes mean equal prefixes up to hash
  collisions, and a hit is verified against the content itself: the candidate must hold the same
  tokens, and the block before it must be the very block this sequence matched for block i-1. Each
  registration gets a fresh `content_id` that is never reused, and a block records its predecessor's
  content_id, so by induction a verified hit holds exactly this prefix: a collision can only miss.
A freed block keeps its content and stays findable until the free list hands it out again: never
registered blocks go first, then registered ones, least recently freed first.

Writing into a block that others hold would change their K/V: a sequence about to write into a
partly-filled block it shares first gets a private copy (copy-on-write); `append` returns the
(source, destination) pairs whose contents the cache must copy.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[int | None, tuple[int, ...]], int]


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """h_i = hash((h_{i-1}, tokens_i)); Python hashes tuples of ints deterministically."""
    return hash((prev_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0                  # sequences holding this block
    hash: int | None = None             # chained hash of the prefix it ends (registered full blocks)
    token_ids: tuple[int, ...] = ()     # its tokens, once registered: verifies a hash hit
    content_id: int = 0                 # unique per registration; 0: not registered
    parent_content_id: int = 0          # content_id of the block before it in its sequence (0: first)

    def unregister(self) -> None:
        self.hash, self.token_ids, self.content_id, self.parent_content_id = None, (), 0, 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_fn: HashFn = chain_hash) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next out
        self.cached_block_ids: dict[int, int] = {}      # hash -> registered block (held or free)
        self.block_tables: dict[int, list[int]] = {}    # seq_id -> physical blocks in logical order
        self.num_tokens: dict[int, int] = {}            # seq_id -> token slots claimed
        self.num_registered: dict[int, int] = {}        # seq_id -> leading blocks already registered
        self._next_content_id = 1
        self.num_cacheable_blocks = 0    # full prompt blocks looked up in the prefix cache
        self.num_hit_blocks = 0          # of which were found there

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    # -- admission ---------------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of a new sequence whose K/V registered blocks hold (prefix caching)."""
        return len(self._match_prefix(token_ids)) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int | None = None,
                     num_cached: int | None = None) -> bool:
        """Room for a new sequence of `num_tokens` slots (default: its tokens) whose first `num_cached`
        tokens (whole blocks of `token_ids`; default: every prefix-cache hit) come from the prefix
        cache: fresh blocks, plus cached free blocks it revives."""
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._hits(token_ids, num_cached)
        num_fresh = self.num_blocks_for(num_tokens) - len(hits)
        num_revived = sum(self.blocks[b].ref_count == 0 for b in hits)
        return num_fresh + num_revived <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int | None = None,
                 num_cached: int | None = None) -> int:
        """Claim `num_tokens` slots for a new sequence, its first `num_cached` tokens from the prefix
        cache (defaults as can_allocate); returns how many leading tokens are cached."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(token_ids, num_tokens, num_cached):
            raise RuntimeError(f"allocate(seq {seq_id}) without room: call can_allocate first")
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._hits(token_ids, num_cached)
        if self.enable_prefix_caching:
            self.num_cacheable_blocks += self._num_cacheable(len(token_ids))
            self.num_hit_blocks += len(hits)
        table = []
        for block_id in hits:               # revive hits first: taking fresh blocks must not evict them
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            table.append(block_id)
        table += [self._take_free_block() for _ in range(self.num_blocks_for(num_tokens) - len(hits))]
        self.block_tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        self.num_registered[seq_id] = len(hits)
        return len(hits) * self.block_size

    def _hits(self, token_ids: Sequence[int], num_cached: int | None) -> list[int]:
        """The registered blocks a new sequence takes: its first num_cached tokens (None: every hit)."""
        if num_cached is None:
            return self._match_prefix(token_ids)
        if num_cached % self.block_size:
            raise ValueError(f"{num_cached} cached tokens is not a whole number of {self.block_size}-token blocks")
        hits = self._match_prefix(token_ids)[:num_cached // self.block_size]
        if len(hits) * self.block_size != num_cached:
            raise ValueError(f"{num_cached} cached tokens claimed but the prefix cache holds "
                             f"{len(hits) * self.block_size} of them")
        return hits

    def _num_cacheable(self, num_tokens: int) -> int:
        # Only full blocks before the last token: the last token must be fed to get its logits, and
        # the block it is written into must not be shared.
        return (num_tokens - 1) // self.block_size

    def _match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The registered blocks holding this sequence's leading full blocks, in order, verified."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev_hash, prev_content_id = None, 0
        bs = self.block_size
        for i in range(self._num_cacheable(len(token_ids))):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prev_hash, tokens)
            block_id = self.cached_block_ids.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_content_id != prev_content_id:
                break                         # a hash collision: a different prefix
            hits.append(block_id)
            prev_hash, prev_content_id = h, block.content_id
        return hits

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.content_id:                  # its old content is about to be overwritten
            self._forget(block)
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if self.cached_block_ids.get(block.hash) == block.block_id:
            del self.cached_block_ids[block.hash]
        block.unregister()

    # -- growth ------------------------------------------------------------------------------------
    def _needs_copy(self, seq_id: int, num_tokens: int) -> bool:
        """Would writing the next token land in a partly-filled block someone else holds?"""
        n = self.num_tokens[seq_id]
        return num_tokens > 0 and n % self.block_size != 0 and self.blocks[self.block_tables[seq_id][-1]].ref_count > 1

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Room for `num_tokens` more slots of this sequence (new blocks, and a copy-on-write one)."""
        n = self.num_tokens[seq_id]
        num_new = self.num_blocks_for(n + num_tokens) - len(self.block_tables[seq_id])
        return num_new + self._needs_copy(seq_id, num_tokens) <= self.num_free_blocks

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Claim `num_tokens` more slots; returns (source, destination) blocks the cache must copy."""
        if not self.can_append(seq_id, num_tokens):
            raise RuntimeError(f"append(seq {seq_id}, {num_tokens}) without room: call can_append first")
        table = self.block_tables[seq_id]
        copies = []
        if self._needs_copy(seq_id, num_tokens):
            shared = self.blocks[table[-1]]
            private = self._take_free_block()
            shared.ref_count -= 1              # still held by the others: never 0 here
            copies.append((shared.block_id, private))
            table[-1] = private
        n = self.num_tokens[seq_id] + num_tokens
        table += [self._take_free_block() for _ in range(self.num_blocks_for(n) - len(table))]
        self.num_tokens[seq_id] = n
        return copies

    def commit(self, seq_id: int, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """The K/V of the first `num_tokens` of `token_ids` (default: all) is computed: register the
        full blocks they fill, so that a sequence admitted later may take them."""
        if not self.enable_prefix_caching:
            return
        table, bs = self.block_tables[seq_id], self.block_size
        num_computed = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        num_full = min(num_computed, self.num_tokens[seq_id]) // bs
        for i in range(self.num_registered[seq_id], num_full):
            block = self.blocks[table[i]]
            if block.content_id:               # registered by another holder (a fork) already
                continue
            prev = self.blocks[table[i - 1]] if i else None
            block.token_ids = tuple(token_ids[i * bs:(i + 1) * bs])
            block.hash = self.hash_fn(prev.hash if prev else None, block.token_ids)
            block.parent_content_id = prev.content_id if prev else 0
            block.content_id = self._next_content_id
            self._next_content_id += 1
            self.cached_block_ids[block.hash] = block.block_id   # a duplicate prefix: the newest wins
        self.num_registered[seq_id] = max(self.num_registered[seq_id], num_full)

    # -- sharing and release -----------------------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts with all of the parent's blocks (shared, copied on write)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already holds blocks")
        table = list(self.block_tables[parent_id])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child_id] = table
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.num_registered[child_id] = self.num_registered[parent_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots (rejected speculative tokens); free the blocks past them."""
        n = self.num_tokens[seq_id]
        if not 0 <= num_tokens <= n:
            raise ValueError(f"truncate(seq {seq_id}, {num_tokens}): it holds {n} tokens")
        table = self.block_tables[seq_id]
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]
        if num_tokens % self.block_size and table:
            last = self.blocks[table[-1]]
            # Its tail will be overwritten. Held by us alone, its registered content is no longer
            # true; shared, it stays true for the others and our next write copies it first.
            if last.content_id and last.ref_count == 1:
                self._forget(last)
        self.num_tokens[seq_id] = num_tokens
        self.num_registered[seq_id] = min(self.num_registered[seq_id], num_tokens // self.block_size)

    def free(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop its hold on every block."""
        for block_id in reversed(self.block_tables.pop(seq_id)):   # tail first: evicted before the prefix
            self._release(block_id)
        del self.num_tokens[seq_id], self.num_registered[seq_id]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count < 1:
            raise RuntimeError(f"block {block_id} released more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if not block.content_id:           # nothing worth keeping: hand it out before cached ones
                self.free_block_ids.move_to_end(block_id, last=False)

    # -- checks ------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it after every step)."""
        holders = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert len(table) == self.num_blocks_for(self.num_tokens[seq_id]), f"seq {seq_id}: table length"
            assert len(set(table)) == len(table), f"seq {seq_id}: a block twice in one table"
            for block_id in table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id}: ref count"
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids), \
                f"block {block.block_id}: free iff unreferenced"
        for h, block_id in self.cached_block_ids.items():
            block = self.blocks[block_id]
            assert block.hash == h and block.content_id, f"block {block_id}: stale cache entry"
