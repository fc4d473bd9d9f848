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
registered blocks first (the last freed first, then those never handed out, which cost nothing until
then: a pool of any size is built at once), then registered ones, least recently freed first.

Writing into a block that others hold would change their K/V: a sequence about to write into a
partly-filled block it shares first gets a private copy (copy-on-write; `append` returns the
(source, destination) pairs the cache must copy). One it holds alone that is registered (truncated
into, then appended to) is unregistered first: a registration always names what the block holds.

Blocks before a sliding window that no later query reaches go back (`free_before`; not with prefix
caching), NULL_BLOCK left in their entries (vLLM's null block): attention's window mask hides them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from numbers import Integral

from ablate_kv_cache.block_checks import NULL_BLOCK, check_invariants
from ablate_kv_cache.prefix_hashes import HashFn, Registration, chain_hash

class UnknownSequenceError(KeyError):
    """A call named a sequence that holds no blocks (never allocated, or freed already)."""
    def __str__(self) -> str:          # KeyError's own would quote the message
        return str(self.args[0])


def _count(name: str, value: object, minimum: int = 0) -> int:
    """`value` as an int, or a ValueError naming the argument (a bad count corrupts the tables)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_fn: HashFn = chain_hash) -> None:
        self.num_blocks = _count("num_blocks", num_blocks, 1)
        self.block_size = _count("block_size", block_size, 1)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.ref_counts: dict[int, int] = {}            # held block -> sequences holding it (free: absent)
        self.registrations: dict[int, Registration] = {}   # registered block (held or free) -> its content
        self.cached_block_ids: dict[int, int] = {}      # hash -> registered block (held or free)
        # the free list, next out first: _released (a stack), then blocks _next_unused.., then _cached_free
        self._released: list[int] = []                  # freed blocks that hold nothing registered
        self._next_unused = 0                           # blocks from here on were never handed out
        self._cached_free: OrderedDict[int, None] = OrderedDict()   # freed registered blocks, LRU first
        self.block_tables: dict[int, list[int]] = {}    # seq_id -> physical blocks in logical order
        self.num_tokens: dict[int, int] = {}            # seq_id -> token slots claimed
        self.num_registered: dict[int, int] = {}        # seq_id -> leading blocks already registered
        self._next_content_id = 1
        self.num_cacheable_blocks = 0    # full prompt blocks looked up in the prefix cache
        self.num_hit_blocks = 0          # of which were found there

    # -- sizes -------------------------------------------------------------------------------------
    num_free_blocks = property(lambda self: self.num_blocks - len(self.ref_counts))
    num_used_blocks = property(lambda self: len(self.ref_counts))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts.get(block_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        table = self.block_tables.get(seq_id)
        if table is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks (never allocated, or freed already)")
        return table

    # -- admission ---------------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of a new sequence whose K/V registered blocks hold (prefix caching)."""
        return len(self._match_prefix(token_ids)) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int | None = None,
                     num_cached: int | None = None) -> bool:
        """Room for a new sequence of `num_tokens` slots (default: its tokens) whose first `num_cached`
        tokens (whole blocks of `token_ids`; default: every prefix-cache hit) come from the prefix
        cache: fresh blocks, plus cached free blocks it revives."""
        return self.blocks_to_allocate(token_ids, num_tokens, num_cached) <= self.num_free_blocks

    def blocks_to_allocate(self, token_ids: Sequence[int], num_tokens: int | None = None,
                           num_cached: int | None = None) -> int:
        """Free blocks allocate() would take (arguments as can_allocate): fresh ones and revived hits."""
        num_tokens = len(token_ids) if num_tokens is None else _count("num_tokens", num_tokens)
        hits = self._hits(token_ids, num_tokens, num_cached)
        num_fresh = self.num_blocks_for(num_tokens) - len(hits)
        return num_fresh + sum(b not in self.ref_counts for b in hits)

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int | None = None,
                 num_cached: int | None = None) -> int:
        """Claim `num_tokens` slots for a new sequence, its first `num_cached` tokens from the prefix
        cache (defaults as can_allocate); returns how many leading tokens are cached."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(token_ids, num_tokens, num_cached):
            raise RuntimeError(f"allocate(seq {seq_id}) without room: call can_allocate first")
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._hits(token_ids, num_tokens, num_cached)
        if self.enable_prefix_caching:
            self.num_cacheable_blocks += self._num_cacheable(len(token_ids))
            self.num_hit_blocks += len(hits)
        for block_id in hits:               # revive hits first: taking fresh blocks must not evict them
            if block_id not in self.ref_counts:
                del self._cached_free[block_id]
            self.ref_counts[block_id] = self.ref_counts.get(block_id, 0) + 1
        fresh = [self._take_free_block() for _ in range(self.num_blocks_for(num_tokens) - len(hits))]
        self.block_tables[seq_id] = hits + fresh
        self.num_tokens[seq_id] = num_tokens
        self.num_registered[seq_id] = len(hits)
        return len(hits) * self.block_size

    def _hits(self, token_ids: Sequence[int], num_tokens: int, num_cached: int | None) -> list[int]:
        """The registered blocks a new sequence takes: its first num_cached tokens (None: all hits)."""
        hits = self._match_prefix(token_ids)
        if num_cached is None:
            return hits[:num_tokens // self.block_size]
        if _count("num_cached", num_cached) % self.block_size:
            raise ValueError(f"{num_cached} cached tokens is not a whole number of {self.block_size}-token blocks")
        if num_cached > num_tokens:
            raise ValueError(f"{num_cached} cached tokens claimed for a sequence of {num_tokens} slots")
        hits = hits[:num_cached // self.block_size]
        if len(hits) * self.block_size != num_cached:
            raise ValueError(f"{num_cached} cached tokens claimed but the prefix cache holds "
                             f"{len(hits) * self.block_size} of them")
        return hits

    def _num_cacheable(self, num_tokens: int) -> int:
        # Full blocks before the last token: it is fed (for its logits) into a block nobody shares
        return (num_tokens - 1) // self.block_size

    def _match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The registered blocks holding this sequence's leading full blocks, in order, verified."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev_hash, prev_content_id, bs = None, 0, self.block_size
        for i in range(self._num_cacheable(len(token_ids))):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prev_hash, tokens)
            reg = self.registrations.get(self.cached_block_ids.get(h, -1))
            if reg is None or reg.token_ids != tokens or reg.parent_content_id != prev_content_id:
                break                         # not cached, or a hash collision: a different prefix
            hits.append(self.cached_block_ids[h])
            prev_hash, prev_content_id = h, reg.content_id
        return hits

    def _take_free_block(self) -> int:
        if self._released:
            block_id = self._released.pop()
        elif self._next_unused < self.num_blocks:
            block_id, self._next_unused = self._next_unused, self._next_unused + 1
        else:
            self._forget(block_id := self._cached_free.popitem(last=False)[0])
        self.ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:   # unregister: its content is about to change
        reg = self.registrations.pop(block_id)
        if self.cached_block_ids.get(reg.hash) == block_id:
            del self.cached_block_ids[reg.hash]

    # -- growth ------------------------------------------------------------------------------------
    def _writes_into_last(self, seq_id: int, num_tokens: int) -> bool:   # its partly-filled last block?
        return num_tokens > 0 and self.num_tokens[seq_id] % self.block_size != 0

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Room for `num_tokens` more slots of this sequence (new blocks, and a copy-on-write one)."""
        return self.blocks_to_append(seq_id, num_tokens) <= self.num_free_blocks

    def blocks_to_append(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks append(seq_id, num_tokens) would take: new ones, and a copy-on-write one."""
        table, num_tokens = self.block_table(seq_id), _count("num_tokens", num_tokens)
        num_new = self.num_blocks_for(self.num_tokens[seq_id] + num_tokens) - len(table)
        needs_copy = self._writes_into_last(seq_id, num_tokens) and self.ref_counts[table[-1]] > 1
        return num_new + needs_copy

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Claim `num_tokens` more slots; returns (source, destination) blocks the cache must copy."""
        if not self.can_append(seq_id, num_tokens):
            raise RuntimeError(f"append(seq {seq_id}, {num_tokens}) without room: call can_append first")
        table = self.block_tables[seq_id]
        copies = []
        if self._writes_into_last(seq_id, num_tokens):
            last = table[-1]
            if self.ref_counts[last] > 1:      # others read it: write into a private copy
                private = self._take_free_block()
                self.ref_counts[last] -= 1     # still held by the others: never 0 here
                copies.append((last, private))
                table[-1] = private
            elif last in self.registrations:   # ours alone, registered with tokens we overwrite now
                self._forget(last)
        n = self.num_tokens[seq_id] + num_tokens
        table += [self._take_free_block() for _ in range(self.num_blocks_for(n) - len(table))]
        self.num_tokens[seq_id] = n
        return copies

    def commit(self, seq_id: int, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """The K/V of the first `num_tokens` of `token_ids` (default: all) is computed: register the
        full blocks they fill, so that a sequence admitted later may take them."""
        table, bs = self.block_table(seq_id), self.block_size
        if not self.enable_prefix_caching:
            return
        num_computed = len(token_ids) if num_tokens is None else min(_count("num_tokens", num_tokens), len(token_ids))
        num_full = min(num_computed, self.num_tokens[seq_id]) // bs
        for i in range(self.num_registered[seq_id], num_full):
            if table[i] in self.registrations:     # registered by another holder (a fork) already
                continue
            prev = self.registrations.get(table[i - 1]) if i else None
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(prev.hash if prev else None, tokens)
            self.registrations[table[i]] = Registration(h, tokens, self._next_content_id,
                                                        prev.content_id if prev else 0)
            self._next_content_id += 1
            self.cached_block_ids[h] = table[i]    # a duplicate prefix: the newest wins
        self.num_registered[seq_id] = max(self.num_registered[seq_id], num_full)

    # -- sharing and release -----------------------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts with all of the parent's blocks (shared, copied on write)."""
        table = list(self.block_table(parent_id))
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already holds blocks")
        for block_id in (b for b in table if b != NULL_BLOCK):
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.num_registered[child_id] = self.num_registered[parent_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots (rejected speculative tokens); free the blocks past them.
        A registered block truncated into keeps its registration until a write changes it (append)."""
        table, n = self.block_table(seq_id), self.num_tokens[seq_id]
        if _count("num_tokens", num_tokens) > n:
            raise ValueError(f"truncate(seq {seq_id}, num_tokens={num_tokens}): it holds {n} tokens")
        keep = self.num_blocks_for(num_tokens)
        for block_id in (b for b in reversed(table[keep:]) if b != NULL_BLOCK):
            self._release(block_id)
        del table[keep:]
        self.num_tokens[seq_id] = num_tokens
        self.num_registered[seq_id] = min(self.num_registered[seq_id], num_tokens // self.block_size)

    def free(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop its hold on every block."""
        # tail first: evicted before the prefix
        for block_id in (b for b in reversed(self.block_table(seq_id)) if b != NULL_BLOCK):
            self._release(block_id)
        del self.block_tables[seq_id], self.num_tokens[seq_id], self.num_registered[seq_id]

    def free_before(self, seq_id: int, position: int) -> int:
        """No query of the sequence reads a key before `position` again (a sliding window): give back
        the blocks wholly before it, i < position // block_size, NULL_BLOCK in their place; how many.
        The freed entries are a prefix of the table (the position only grows), so only the entries
        since the last call are visited: a step's cost does not grow with the sequence."""
        if self.enable_prefix_caching:
            raise RuntimeError("free_before with prefix caching: a freed block's prefix could not be matched whole")
        table = self.block_table(seq_id)
        end = start = min(_count("position", position) // self.block_size, len(table))
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = NULL_BLOCK
        return end - start

    def _release(self, block_id: int) -> None:
        count = self.ref_counts.pop(block_id, 0)
        if count < 1:
            raise RuntimeError(f"block {block_id} released more often than it was taken")
        if count > 1:
            self.ref_counts[block_id] = count - 1
        elif block_id in self.registrations:
            self._cached_free[block_id] = None     # findable until handed out, least recently freed first
        else:
            self._released.append(block_id)        # nothing worth keeping: handed out before cached ones

    # -- checks ------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it after every step)."""
        check_invariants(self)
