"""The block manager under random allocate / append / fork / truncate / free sequences (hypothesis).

A model of the pool's contents runs beside it: every slot records the token prefix whose K/V it
holds (the K/V of token p depends on tokens 0..p). After every step, every live sequence must find
its own prefix in every slot of its block table. That one check means no write ever landed in a
block another sequence still reads, copy-on-write copied the right block, and a prefix-cache hit only
ever handed out an identical prefix. The bookkeeping must stay consistent (ref count = holders, free
iff unreferenced, no block twice in a table), and once every sequence has finished every block is free.

Prefix-cache registrations are checked against the model too: every registered block must hold the
tokens it is registered with, after the prefix its chained hash names. Rules aim at the case that
once broke it: truncate into a shared registered block, free the others holding it, then write
diverging tokens into it (a stale registration that handed later prompts the wrong K/V).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ablate_kv_cache.block_manager import BlockManager, UnknownSequenceError, chain_hash

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
            assert self.manager.ref_count(block) == 1, f"write into block {block}, which others hold"
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
        table = self.manager.block_table(seq_id)
        for p in range(num_cached):          # what the prefix cache handed out is this very prefix
            assert self.storage.get((table[p // self.bs], p % self.bs)) == tuple(tokens[:p + 1]), \
                f"allocate said {num_cached} tokens are cached, but position {p} holds another prefix's K/V"
        self.tokens[seq_id] = list(tokens)
        self.seen.append(list(tokens))
        self.write(seq_id, num_cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=TOKENS)
    def append(self, data, more: list[int]) -> None:
        self.extend(self.live(data), more)

    def extend(self, seq_id: int, more: list[int]) -> None:
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

    # -- aimed at stale registrations: truncate into a shared registered block, leave it alone, rewrite it
    def shared_registered(self) -> list[tuple[int, int]]:
        """(sequence, block index) of every registered block a live sequence shares with another."""
        m = self.manager
        return [(seq_id, i) for seq_id in sorted(self.tokens) for i, b in enumerate(m.block_table(seq_id))
                if m.ref_count(b) > 1 and b in m.registrations]

    @precondition(lambda self: self.tokens and self.bs > 1)
    @rule(data=st.data())
    def truncate_into_shared_registered(self, data) -> None:
        self.truncate_into_shared(data)

    def truncate_into_shared(self, data) -> int | None:
        candidates = self.shared_registered()
        if not candidates:
            return None
        seq_id, i = data.draw(st.sampled_from(candidates))
        in_block = min(self.bs - 1, len(self.tokens[seq_id]) - i * self.bs)   # >= 1: it holds block i
        keep = i * self.bs + data.draw(st.integers(1, in_block))       # inside the block: its tail goes
        self.manager.truncate(seq_id, keep)
        del self.tokens[seq_id][keep:]
        return seq_id

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_the_others_sharing_its_last_block(self, data) -> None:
        self.free_others(self.live(data))

    def free_others(self, seq_id: int) -> None:
        table = self.manager.block_table(seq_id)
        if table:
            for other in [o for o in self.tokens if o != seq_id and table[-1] in self.manager.block_table(o)]:
                self.manager.free(other)
                del self.tokens[other]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=TOKENS)
    def append_diverging(self, data, extra: list[int]) -> None:
        self.diverge(self.live(data), extra)

    def diverge(self, seq_id: int, extra: list[int]) -> None:
        """Fill the last block with other tokens than a registration of it says it holds."""
        table, n = self.manager.block_table(seq_id), len(self.tokens[seq_id])
        reg = self.manager.registrations.get(table[-1]) if table and n % self.bs else None
        if reg is not None:
            self.extend(seq_id, [1 - t for t in reg.token_ids[n % self.bs:]] + extra)

    @precondition(lambda self: self.tokens and self.bs > 1)
    @rule(data=st.data(), extra=TOKENS)
    def rewrite_a_shared_registered_block_alone(self, data, extra: list[int]) -> None:
        """All three at once: truncate into a shared registered block (fork one to share it if none is
        shared yet), free the others holding it, rewrite it."""
        holders = [q for q in sorted(self.tokens) if set(self.manager.block_table(q)) & set(self.manager.registrations)]
        if holders and not self.shared_registered():
            child, self.next_id = self.next_id, self.next_id + 1
            parent = data.draw(st.sampled_from(holders))
            self.manager.fork(parent, child)
            self.tokens[child] = list(self.tokens[parent])
        seq_id = self.truncate_into_shared(data)
        if seq_id is not None:
            self.free_others(seq_id)
            self.diverge(seq_id, extra)

    # -- properties ----------------------------------------------------------------------------------
    @invariant()
    def every_sequence_reads_its_own_prefix(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        self.registrations_name_what_blocks_hold()
        for seq_id, tokens in self.tokens.items():
            table = self.manager.block_table(seq_id)
            for p in range(len(tokens)):
                assert self.storage.get((table[p // self.bs], p % self.bs)) == tuple(tokens[:p + 1]), \
                    f"sequence {seq_id} position {p} reads another prefix's K/V"

    def registrations_name_what_blocks_hold(self) -> None:
        bs = self.bs
        for block, reg in self.manager.registrations.items():
            full = self.storage.get((block, bs - 1))
            assert full is not None and full[-bs:] == reg.token_ids, \
                f"block {block} is registered as {reg.token_ids} but holds {full and full[-bs:]}"
            for slot in range(bs):
                assert self.storage.get((block, slot)) == full[:len(full) - bs + slot + 1], \
                    f"block {block} slot {slot}: not the prefix it is registered with"
            h = None
            for i in range(len(full) // bs):
                h = self.hash_fn(h, full[i * bs:(i + 1) * bs])
            assert h == reg.hash, f"block {block}: registered under a hash its prefix does not have"

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


FAST = settings(max_examples=100, stateful_step_count=20, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = FAST
TestCollidingHash = CollidingHashMachine.TestCase
TestCollidingHash.settings = FAST


class ManyStepsMachine(BlockManagerMachine):
    """The same machine, run much longer (pytest -m slow)."""


MANY = settings(max_examples=600, stateful_step_count=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerManySteps = pytest.mark.slow(ManyStepsMachine.TestCase)
TestBlockManagerManySteps.settings = MANY


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


# -- regressions: a stale registration, bad counts, unknown sequences, the free list's order ---------------

def test_a_shared_block_truncated_into_then_rewritten_alone_is_not_found_by_its_old_tokens():
    m = BlockManager(4, 4, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.commit(0, [1, 2, 3, 4, 5])                   # block A = [1, 2, 3, 4] registered
    assert m.allocate(1, [1, 2, 3, 4, 6]) == 4     # seq 1 shares A
    m.commit(1, [1, 2, 3, 4, 6])
    a = m.block_table(0)[0]
    m.truncate(0, 2)                               # into A while seq 1 still holds it: A stays registered
    m.free(1)                                      # now seq 0 holds A alone
    assert m.append(0, 2) == []                    # written in place: A's registration must go
    m.commit(0, [1, 2, 9, 9])                      # A holds [1, 2, 9, 9]
    assert m.block_table(0) == [a] and m.registrations[a].token_ids == (1, 2, 9, 9)
    assert m.allocate(2, [1, 2, 3, 4, 7]) == 0     # was 4: A handed out as if it held [1, 2, 3, 4]
    assert a not in m.block_table(2)
    m.free(2)
    assert m.allocate(3, [1, 2, 9, 9, 7]) == 4 and m.block_table(3)[0] == a   # found by what it holds
    m.check_invariants()


def test_a_shared_block_truncated_into_is_copied_on_write_and_keeps_its_registration():
    m = BlockManager(4, 4, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.commit(0, [1, 2, 3, 4, 5])
    m.allocate(1, [1, 2, 3, 4, 6])
    a = m.block_table(0)[0]
    m.truncate(0, 2)
    copies = m.append(0, 2)                        # seq 1 still reads A: seq 0 writes into a copy
    assert copies == [(a, m.block_table(0)[0])] and m.block_table(0)[0] != a
    m.commit(0, [1, 2, 9, 9])
    assert m.registrations[a].token_ids == (1, 2, 3, 4)
    assert m.allocate(2, [1, 2, 3, 4, 7]) == 4 and m.block_table(2)[0] == a
    m.check_invariants()


@pytest.mark.parametrize("bad", [-3, -1, 1.5, "2", True])
def test_a_negative_or_non_integer_count_is_refused_and_changes_nothing(bad):
    m = BlockManager(8, 4)
    m.allocate(0, [1, 2, 3, 4, 5])
    before = (list(m.block_table(0)), dict(m.num_tokens), m.num_free_blocks)
    for call in (lambda: m.append(0, bad), lambda: m.can_append(0, bad), lambda: m.truncate(0, bad),
                 lambda: m.allocate(1, [1, 2], num_tokens=bad), lambda: m.can_allocate([1, 2], num_tokens=bad)):
        with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
            call()
    assert (list(m.block_table(0)), dict(m.num_tokens), m.num_free_blocks) == before
    m.check_invariants()


def test_a_truncation_past_the_end_names_the_sequence_and_its_length():
    m = BlockManager(8, 4)
    m.allocate(0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"truncate\(seq 0, num_tokens=4\): it holds 3 tokens"):
        m.truncate(0, 4)


def test_calls_on_an_unknown_sequence_name_it():
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3])
    m.free(0)
    calls = {"free": lambda: m.free(0), "fork": lambda: m.fork(7, 8), "append": lambda: m.append(7, 1),
             "can_append": lambda: m.can_append(7, 1), "truncate": lambda: m.truncate(7, 0),
             "commit": lambda: m.commit(7, [1, 2]), "block_table": lambda: m.block_table(7)}
    for name, call in calls.items():
        with pytest.raises(UnknownSequenceError, match=r"sequence (0|7) holds no blocks") as err:
            call()
        assert isinstance(err.value, KeyError), name
        assert str(err.value).startswith("sequence"), f"{name}: {err.value!s}"   # not KeyError's quoted repr
    assert 8 not in m.block_tables and m.num_free_blocks == 8
    m.check_invariants()


def test_a_huge_pool_costs_only_the_blocks_in_use():
    m = BlockManager(10**15, 16, enable_prefix_caching=True)       # was one Python object per block
    m.allocate(0, list(range(40)))
    m.commit(0, list(range(40)))
    assert m.block_table(0) == [0, 1, 2] and m.num_free_blocks == 10**15 - 3
    m.free(0)
    assert m.allocate(1, list(range(33))) == 32
    m.check_invariants()


def test_the_free_list_hands_out_plain_freed_blocks_first_then_unused_then_cached_least_recent_first():
    m = BlockManager(6, 2, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3])                       # blocks 0 [1, 2] (registered), 1 [3]
    m.commit(0, [1, 2, 3])
    m.allocate(1, [5, 6, 7])                       # blocks 2 [5, 6] (registered), 3 [7]
    m.commit(1, [5, 6, 7])
    m.free(0)                                      # 1: plain, first out; 0: cached
    m.free(1)                                      # 3: plain, before 1 (last freed first); 2: cached, after 0
    m.allocate(2, [9] * 12)                        # six blocks: 3, 1, then never used 4, 5, then 0, 2
    assert m.block_table(2) == [3, 1, 4, 5, 0, 2]
    assert m.cached_block_ids == {} and m.registrations == {}   # the cached ones were overwritten
    m.check_invariants()
