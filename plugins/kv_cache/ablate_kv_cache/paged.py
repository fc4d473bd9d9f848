"""kv_cache=paged: K/V in fixed-size blocks of one shared pool, claimed as sequences grow (vLLM).

Storage is one preallocated pool each for K and V, (layers, num_blocks, block_size, H_kv, D); the
block manager (block_manager.py) decides which blocks each sequence holds. A sequence claims only
the blocks its tokens fill (admit: its prompt; grow: one more block every block_size tokens), so the
cache admits while blocks remain, and when they run out the scheduler preempts.

Writes go through one flat slot index per step, slot = block_table[p // bs] * bs + p % bs (nano-vllm's
slot mapping), so a step mixing prefill chunks and decode tokens is one index_copy_ per layer.
Attention reads the pool through the batch's block tables (ablate.api.kv.PagedKV).

Sliding windows (vLLM's hybrid KV-cache manager): layers are grouped by window (layer_groups.py), each
group with its own block table per sequence, the pool (g, num_blocks, block_size, H_kv, D) for groups
of g layers. After each step a windowed group gives back the blocks wholly before the window of the
sequence's next query (position C - window + 1, C its committed tokens): no later query reads them,
drafts included, since a step's queries sit at positions >= C. Their entries stay in the table as
NULL_BLOCK, sent to attention as block 0 (finite numbers), which the layer's window mask hides. A
sequence so holds at most ceil((window - 1 + max step tokens) / block_size) + 1 blocks in a windowed
group, and admission and the pool's size count that. With prefix caching every layer stays in one
group that keeps every block (a freed block's prefix could not be matched whole): kv_block_groups = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ablate.api import (BuildContext, KVBudgetConfig, KVCache, PagedKV, PagedPlaces, PluginError, Sequence, Stat, StepInputs,
                        budget_bytes, device_tensor)
from ablate_kv_cache.block_manager import NULL_BLOCK, BlockManager
from ablate_kv_cache.layer_groups import layer_groups
from ablate_kv_cache.paging_model import PREDICTION_STATS, predict
from ablate_kv_cache.slot_cache import check_pool_fits


@dataclass
class PagedConfig(KVBudgetConfig):
    name: str = "paged"
    block_size: int = 16           # token slots per block: smaller wastes less of each last block,
                                   # larger means fewer, longer gathers
    prefix_caching: bool = False   # share the full blocks of identical prompt prefixes instead of recomputing them

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"kv_cache.block_size must be >= 1, got {self.block_size}")


class PagedKVCache(KVCache):
    name = "paged"
    config_class = PagedConfig
    graph_safe = True     # slot mapping and fixed-width block tables are in step.plan
    reported_stats = (
        Stat("kv_block_size", "token slots per block", "tokens"),
        Stat("kv_block_bytes", "bytes per block (the slots of one group's layers)", "bytes"),
        Stat("kv_block_groups", "block tables per sequence: groups of layers by sliding window", "count"),
        Stat("kv_blocks_freed_by_window", "blocks given back from before a sliding window", "count"),
        Stat("kv_blocks_total", "blocks in the pool", "count"),
        Stat("kv_pool_bytes", "bytes of the preallocated pool", "bytes"),
        Stat("kv_blocks_used_peak", "most blocks held at once", "count"),
        Stat("kv_blocks_free_min", "fewest blocks free at once", "count"),
        Stat("kv_frag_slots_mean", "slots of the stepped sequences' blocks holding no token, per step (mean)", "tokens"),
        Stat("kv_frag_slots_per_seq_mean", "... per sequence (mean): about block_size / 2", "tokens",
             table="KV cache"),
        Stat("max_seqs_admitted", "most sequences holding blocks at once", "count"),
        Stat("prefix_cache_hit_blocks", "prompt blocks taken from the prefix cache", "count"),
        Stat("prefix_cache_hit_rate", "of the full prompt blocks looked up, the share found", "fraction"),
    ) + PREDICTION_STATS

    def __init__(self, config: PagedConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        s = self.spec
        self.block_size = bs = config.block_size
        # layers by window, one block table each (one group of every layer without windows)
        self.groups = layer_groups(s, free_outside_windows=not config.prefix_caching)
        self.windowed = any(group.window is not None for group in self.groups)
        # layer -> (its group, its index in the pool's layers)
        self._where = {layer: (g, i) for g, group in enumerate(self.groups) for i, layer in enumerate(group.layers)}
        # paged_slots: per layer (pool, group), where write() and view() are these (a subclass replacing
        # one says where its rows go itself)
        self._places = tuple((i, g) for _, (g, i) in sorted(self._where.items()))
        self._gives_places = all(getattr(type(self), name) is getattr(PagedKVCache, name)
                                 for name in ("write", "view", "_pool_views"))
        group_layers = len(self.groups[0].layers)
        self.block_bytes = bs * s.bytes_per_token * group_layers // s.num_layers
        self.blocks_per_seq = -(-s.max_seq_len // bs)       # the width of every block table
        blocks_per_seq = sum(group.blocks_per_seq(s, bs) for group in self.groups)   # the most a sequence holds
        # More blocks than max_num_seqs sequences of the longest length can hold would never be
        # claimed (with prefix caching they would only keep more freed prefixes findable).
        num_blocks = s.max_num_seqs * blocks_per_seq
        budget = budget_bytes(config, s.device, s.bytes_per_token)
        if budget:
            num_blocks = min(num_blocks, budget // self.block_bytes)
            if num_blocks < blocks_per_seq:
                raise ValueError(
                    f"kv_cache=paged: the KV budget of {budget} bytes holds {num_blocks} blocks of {bs} tokens "
                    f"({self.block_bytes} bytes each), fewer than one sequence of {s.max_seq_len} tokens needs "
                    f"({blocks_per_seq}): raise kv_cache.budget_bytes or shorten the workload")
        # before allocating anything: a pool larger than the free memory fails with a clear message
        check_pool_fits(self.name, num_blocks * self.block_bytes, blocks_per_seq * self.block_bytes, s, config,
                        budget)
        self.manager = BlockManager(num_blocks, bs, config.prefix_caching)
        self.k = torch.zeros(group_layers, num_blocks, bs, s.n_kv_heads, s.k_head_dim, dtype=s.dtype, device=s.device)
        self.v = torch.zeros(group_layers, num_blocks, bs, s.n_kv_heads, s.v_head_dim, dtype=s.dtype, device=s.device)
        self._views = None          # _pool_views
        # stats
        self.max_seqs_admitted = 0
        self.blocks_used_peak = 0
        self.blocks_freed_by_window = 0
        self._frag_slots: list[int] = []           # per step: unused slots in the stepped sequences' blocks
        self._frag_slots_per_seq: list[float] = []
        self._lengths_admitted: dict[int, tuple[int, int]] = {}   # seq_id -> (prompt, max output), for predictions

    # -- room --------------------------------------------------------------------------------------
    def num_cached_tokens(self, seq: Sequence) -> int:
        return self.manager.cached_prefix(seq.token_ids)

    def _keys(self, seq_id: int) -> list[tuple[int, int]]:
        """The block manager's name of each of the sequence's tables: (seq_id, group)."""
        return [(seq_id, g) for g in range(len(self.groups))]

    def _claimed(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Per group, the slots to hold for room of `num_tokens`. A windowed group holds those the next
        step can write only, up to C + the most tokens a step feeds (C: computed): a scheduler may ask for
        a whole prompt at once (static), but commits shrink the room to C, so each step asks again."""
        step = self.spec.max_step_tokens or self.spec.max_seq_len
        return [num_tokens if group.window is None else min(num_tokens, seq.num_computed_tokens + step)
                for group in self.groups]

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        manager, keys = self.manager, self._keys(seq.seq_id)
        claims = self._claimed(seq, num_tokens)
        if keys[0] not in manager.block_tables:     # admission: its first num_computed tokens are prefix hits
            need = sum(manager.blocks_to_allocate(seq.token_ids, n, seq.num_computed_tokens) for n in claims)
            if need > manager.num_free_blocks:
                return False
            for key, n in zip(keys, claims):
                manager.allocate(key, seq.token_ids, n, seq.num_computed_tokens)
            self.max_seqs_admitted = max(self.max_seqs_admitted, self.num_seqs_admitted())
            self._lengths_admitted.setdefault(seq.seq_id, (seq.num_prompt_tokens, seq.request.max_new_tokens))
        else:
            extras = [n - manager.num_tokens[key] for key, n in zip(keys, claims)]
            need = sum(manager.blocks_to_append(key, extra) for key, extra in zip(keys, extras) if extra > 0)
            if need > manager.num_free_blocks:
                return False
            for key, extra in zip(keys, extras):
                if extra > 0:
                    self._copy_blocks(manager.append(key, extra))
        self.blocks_used_peak = max(self.blocks_used_peak, manager.num_used_blocks)
        return True

    def keep(self, seq: Sequence, num_tokens: int) -> None:
        manager = self.manager
        for group, key in zip(self.groups, self._keys(seq.seq_id)):
            if manager.num_tokens[key] > num_tokens:     # drafts rejected: give their blocks back
                manager.truncate(key, num_tokens)
            manager.commit(key, seq.token_ids, num_tokens)     # prefix caching: register full blocks
            if group.window is not None:   # the next query, at position num_tokens, sees keys > num_tokens - window
                self.blocks_freed_by_window += manager.free_before(key, max(0, num_tokens - group.window + 1))

    def free(self, seq: Sequence) -> None:
        for key in self._keys(seq.seq_id):
            self.manager.free(key)

    def num_seqs_admitted(self) -> int:
        return len(self.manager.block_tables) // len(self.groups)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a shared, partly-filled block becomes this sequence's own before it writes."""
        for src, dst in copies:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> None:
        bs, manager = self.block_size, self.manager
        most = self.spec.max_step_tokens or self.spec.max_seq_len
        if self.windowed and max(step.query_lens) > most:    # a windowed group holds that many slots past C
            raise PluginError(self, "prepare", f"a sequence feeds {max(step.query_lens)} tokens in one step, more "
                              f"than the {most} the windowed layers' blocks were claimed for (engine.max_num_batched_"
                              f"tokens, and speculative decoding's drafts + 1 within it): raise "
                              f"engine.max_num_batched_tokens to at least {max(step.query_lens)}")
        # per group, per sequence: its table (a group's freed entries are NULL_BLOCK)
        tables = [[manager.block_table((seq.seq_id, g)) for seq in step.seqs] for g in range(len(self.groups))]
        # every group's tables are as long (freed entries count): the unused slots are the last block's tail
        self._frag_slots.append(sum(len(t) * bs - ctx for t, ctx in zip(tables[0], step.context_lens)))
        self._frag_slots_per_seq.append(self._frag_slots[-1] / len(tables[0]))
        # every table as wide as the longest sequence can need, so a step's shapes depend on its
        # batch size only (a captured decode graph replays for any lengths); padding entries, and
        # entries freed before a window, point at block 0: never read inside what a query sees, masked
        width = self.blocks_per_seq
        # slot of the token at position p: its block's physical index * block_size + p % block_size
        slots = [[table[p // bs] * bs + p % bs
                  for table, n, end in zip(group, step.query_lens, step.context_lens) for p in range(end - n, end)]
                 for group in tables]
        rows = [[t + [0] * (width - len(t)) for t in group] for group in tables]
        device = self.spec.device
        # (G, B, width); freed entries (NULL_BLOCK = -1) to block 0 in one operation, not one test an entry
        step.plan["block_tables"] = device_tensor(rows, torch.int32, device).clamp_(min=0)
        step.plan["slot_mapping"] = device_tensor(slots, torch.long, device)                  # (G, T)

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> slots of the flattened (num_blocks * block_size, H_kv, D) pool
        group, i = self._where[layer]
        slots = step.memo("paged/slot_mapping", lambda: step.plan["slot_mapping"].unbind(0))[group]     # (T,)
        _, _, k_slots, v_slots = self._pool_views()[i]
        k_slots.index_copy_(0, slots, k)
        v_slots.index_copy_(0, slots, v)

    def view(self, layer: int, step: StepInputs) -> PagedKV:
        group, i = self._where[layer]
        k, v, _, _ = self._pool_views()[i]
        return PagedKV(k, v, step.memo("paged/block_tables", lambda: step.plan["block_tables"].unbind(0))[group])

    def paged_slots(self, step: StepInputs) -> PagedPlaces | None:
        if not self._gives_places:
            return None
        return PagedPlaces(self.k, self.v, step.plan["slot_mapping"], step.plan["block_tables"], self._places)

    def _pool_views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer of the pool: its K and V (num_blocks, block_size, H_kv, D), and both flattened to slots
        (flatten, not view(-1, ...): MLA's V has zero width, and -1 cannot be inferred from zero elements).
        Made once per pool (a subclass may replace it), not three views a layer a step: at batch 1 each
        write and view is a few microseconds of a step's few tens of milliseconds."""
        views = self._views
        if views is None or views[0] is not self.k or views[1] is not self.v:
            views = self._views = (self.k, self.v, [(k, v, k.flatten(0, 1), v.flatten(0, 1))
                                                    for k, v in zip(self.k, self.v, strict=True)])
        return views[2]

    # -- memory ------------------------------------------------------------------------------------
    def bytes_reserved(self) -> int:
        # The blocks sequences hold, not the pool: the pool is allocated up front only so that no
        # allocation happens while serving, and a free block belongs to no sequence (any sequence
        # may claim it next step), like free memory in an allocator. What is reserved *for
        # sequences* is their blocks, so used / reserved measures the waste paging leaves: the
        # unfilled tail of each last block. The pool's size is reported as kv_pool_bytes.
        return self.manager.num_used_blocks * self.block_bytes

    def bytes_used(self) -> int:
        """Live tokens x bytes per token, a slot shared by several sequences counted once. A windowed
        group's live tokens are the last `window` (what ModelConfig.kv_bytes_at counts)."""
        manager = self.manager
        tables = manager.block_tables
        # the entries held (a freed one, NULL_BLOCK, only in a windowed group's table) against the blocks in use
        held = (sum(b != NULL_BLOCK for t in tables.values() for b in t) if self.windowed
                else sum(len(t) for t in tables.values()))
        if held == manager.num_used_blocks:   # nothing shared
            if not self.windowed:
                return super().bytes_used()
            per_layer = self.bytes_per_token // self.spec.num_layers
            return per_layer * sum(len(group.layers) * (n if group.window is None else min(n, group.window))
                                   for n in self.num_committed().values() for group in self.groups)
        filled: dict[int, int] = {}        # sharing (prefix caching, forks) keeps one group of every layer
        for seq_id, length in self.num_committed().items():
            for i, block_id in enumerate(tables.get((seq_id, 0), ())):
                in_block = min(self.block_size, length - i * self.block_size)
                if in_block > 0:
                    filled[block_id] = max(filled.get(block_id, 0), in_block)
        return sum(filled.values()) * self.bytes_per_token

    def pool_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    # -- stats -------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        manager = self.manager
        cacheable = manager.num_cacheable_blocks
        lengths = list(self._lengths_admitted.values())
        prediction = predict([p for p, _ in lengths], [o for _, o in lengths], self.block_size,
                             manager.num_blocks * self.block_size, self.spec.max_num_seqs,
                             [group.window for group in self.groups])
        return {
            "kv_block_size": self.block_size,
            "kv_block_bytes": self.block_bytes,
            "kv_block_groups": len(self.groups),
            "kv_blocks_freed_by_window": self.blocks_freed_by_window,
            "kv_blocks_total": manager.num_blocks,
            "kv_pool_bytes": self.pool_bytes(),
            "kv_blocks_used_peak": self.blocks_used_peak,
            "kv_blocks_free_min": manager.num_blocks - self.blocks_used_peak,
            "kv_frag_slots_mean": float(np.mean(self._frag_slots)) if self._frag_slots else np.nan,
            "kv_frag_slots_per_seq_mean": float(np.mean(self._frag_slots_per_seq)) if self._frag_slots else np.nan,
            "max_seqs_admitted": self.max_seqs_admitted,
            "prefix_cache_hit_blocks": manager.num_hit_blocks,
            "prefix_cache_hit_rate": manager.num_hit_blocks / cacheable if cacheable else np.nan,
            **prediction,
        }
