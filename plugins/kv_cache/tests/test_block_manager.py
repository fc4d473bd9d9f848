"""The block manager under random allocate / append / fork / truncate / free sequences (hypothesis).

A model of the pool's contents runs beside it: every slot records the token prefix whose K/V it
holds (the K/V of token p depends on tokens 0..p). After every step, every live sequence must find
its own prefix in every slot of its block table. That one check means no write ever landed in a
block another sequence still reads, copy-on-write copied the right block, and a prefix-cache hit only
ever handed out an identical prefix. The bookkeeping must stay consistent (ref count = holders, free
iff unreferenced, no block twice in a table), and once every sequence has finished every block is free.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ablate_kv_cache.block_manager import BlockManager, chain_hash

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=10)   # two token values: prefixes repeat often


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(chain_hash)

    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[int, list[int]] = {}               # live sequence -> the tokens it holds
        self.storage: dict[tuple[int, int], tuple[int, ...]] = {}   # (block, slot) -> prefix whose K/V is there
        self.seen: list[list[int]] = [[0, 1, 0, 1, 0, 1]]    # token lists to reuse: prefix hits
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), prefix_caching=st.booleans())
    def make_manager(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.manager = BlockManager(num_blocks, block_size, prefix_caching, self.hash_fn)
        self.bs = block_size

    # -- what a cache does: write the K/V of positions [start, end) after claiming their slots --------
    def write(self, seq_id: int, start: int) -> None:
        tokens, table = self.tokens[seq_id], self.manager.block_table(seq_id)
        for p in range(start, len(tokens)):
            block = table[p // self.bs]
            assert self.manager.blocks[block].ref_count == 1, f"write into block {block}, which others hold"
            self.storage[(block, p % self.bs)] = tuple(tokens[:p + 1])
        self.manager.commit(seq_id, tokens)

    def live(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    # -- rules ---------------------------------------------------------------------------------------
    @rule(data=st.data(), fresh=TOKENS, reuse=st.booleans())
    def allocate(self, data, fresh: list[int], reuse: bool) -> None:
        tokens = fresh
        if reuse:   # a prefix of something seen before, then new tokens: what prefix caching is for
            old = data.draw(st.sampled_from(self.seen))
            tokens = old[:data.draw(st.integers(1, len(old)))] + fresh[:data.draw(st.integers(0, len(fresh)))]
        if not self.manager.can_allocate(tokens):
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        num_cached = self.manager.allocate(seq_id, tokens)
        assert num_cached % self.bs == 0 and num_cached <= len(tokens) - 1   # the last token is always fed
        if not self.manager.enable_prefix_caching:
            assert num_cached == 0
        self.tokens[seq_id] = list(tokens)
        self.seen.append(list(tokens))
        self.write(seq_id, num_cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=TOKENS)
    def append(self, data, more: list[int]) -> None:
        seq_id = self.live(data)
        if not self.manager.can_append(seq_id, len(more)):
            return
        for src, dst in self.manager.append(seq_id, len(more)):     # copy-on-write before writing
            for slot in range(self.bs):
                if (src, slot) in self.storage:
                    self.storage[(dst, slot)] = self.storage[(src, slot)]
        start = len(self.tokens[seq_id])
        self.tokens[seq_id] += more
        self.seen.append(list(self.tokens[seq_id]))
        self.write(seq_id, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.live(data)
        child, self.next_id = self.next_id, self.next_id + 1
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq_id = self.live(data)
        keep = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.manager.truncate(seq_id, keep)
        del self.tokens[seq_id][keep:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = self.live(data)
        self.manager.free(seq_id)
        del self.tokens[seq_id]

    # -- properties ----------------------------------------------------------------------------------
    @invariant()
    def every_sequence_reads_its_own_prefix(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        for seq_id, tokens in self.tokens.items():
            table = self.manager.block_table(seq_id)
            for p in range(len(tokens)):
                assert self.storage.get((table[p // self.bs], p % self.bs)) == tuple(tokens[:p + 1]), \
                    f"sequence {seq_id} position {p} reads another prefix's K/V"

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_blocks, "blocks leaked"


class CollidingHashMachine(BlockManagerMachine):
    """Every block hashes alike: only the verification against tokens keeps prefixes apart."""

    hash_fn = staticmethod(lambda prev_hash, token_ids: 0)


FAST = settings(max_examples=60, stateful_step_count=20, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = FAST
TestCollidingHash = CollidingHashMachine.TestCase
TestCollidingHash.settings = FAST


# -- worked examples -------------------------------------------------------------------------------------

def test_identical_prefixes_share_full_blocks_and_different_ones_do_not():
    m = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert m.allocate(0, a) == 0
    m.commit(0, a)
    # same first 8 tokens: both full blocks shared, the partial third block is its own
    assert m.allocate(1, a[:8] + [42]) == 8
    assert m.block_table(1)[:2] == m.block_table(0)[:2] and m.block_table(1)[2] != m.block_table(0)[2]
    # same first block, different second: only the first is shared
    assert m.allocate(2, a[:4] + [0, 0, 0, 0, 1]) == 4
    assert m.block_table(2)[0] == m.block_table(0)[0] and m.block_table(2)[1] != m.block_table(0)[1]
    # a prompt equal to the cached blocks still feeds its last token: the last block is not shared
    assert m.allocate(3, a[:8]) == 4
    assert m.num_hit_blocks == 2 + 1 + 1
    # the same block of tokens after a different prefix is a different block (the hash is chained)
    assert m.allocate(4, [0, 0, 0, 0] + a[4:8] + [1]) == 0
    m.check_invariants()


def test_a_freed_prefix_is_found_again_until_its_block_is_reused():
    m = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    m.allocate(0, [5, 6, 7])
    m.commit(0, [5, 6, 7])
    m.free(0)
    assert m.allocate(1, [5, 6, 9]) == 2           # revived from the free list
    m.free(1)
    m.allocate(2, [1, 1, 1, 1, 1, 1])              # takes all three blocks: the cached one is overwritten
    m.free(2)
    assert m.allocate(3, [5, 6, 9]) == 0
    m.check_invariants()


def test_a_hash_collision_misses_instead_of_sharing():
    m = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True, hash_fn=lambda prev, toks: 7)
    m.allocate(0, [1, 2, 3])
    m.commit(0, [1, 2, 3])
    assert m.allocate(1, [3, 4, 5]) == 0           # same hash, other tokens
    assert m.allocate(2, [1, 2, 5]) == 2           # same hash, same tokens
    m.check_invariants()


def test_a_block_rewritten_after_truncation_is_no_longer_found_by_its_old_prefix():
    m = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.commit(0, [1, 2, 3, 4, 5])                  # blocks [1, 2] and [3, 4] registered
    m.truncate(0, 3)                               # rejected tokens: keep [1, 2], [3, _]
    m.append(0, 2)
    m.commit(0, [1, 2, 3, 9, 9])                   # the second block now holds [3, 9]
    assert m.allocate(1, [1, 2, 3, 4, 5]) == 2     # [3, 4] is gone: only the first block is shared
    assert m.allocate(2, [1, 2, 3, 9, 7]) == 4     # [3, 9] is found
    m.check_invariants()


def test_fork_shares_then_copies_on_write():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(0, [1, 2, 3, 4, 5, 6])              # blocks: one full, one half full
    m.fork(0, 1)
    assert m.block_table(1) == m.block_table(0) and m.num_used_blocks == 2
    copies = m.append(1, 1)                         # the child writes into the shared half-full block
    assert copies == [(m.block_table(0)[1], m.block_table(1)[1])]
    assert m.block_table(1)[0] == m.block_table(0)[0]
    assert m.append(0, 1) == []                     # the parent holds its block alone now
    m.free(0)
    m.free(1)
    assert m.num_free_blocks == 4
