"""kv_cache=paged: K/V in fixed-size blocks of one shared pool, claimed as sequences grow (vLLM).

Storage is one preallocated pool each for K and V, (layers, num_blocks, block_size, H_kv, D); the
block manager (block_manager.py) decides which blocks each sequence holds. A sequence claims only
the blocks its tokens fill (admit: its prompt; grow: one more block every block_size tokens), so the
cache admits while blocks remain, and when they run out the scheduler preempts.

Writes go through one flat slot index per step, slot = block_table[p // bs] * bs + p % bs (nano-vllm's
slot mapping), so a step mixing prefill chunks and decode tokens is one index_copy_ per layer.
Attention reads the pool through the batch's block tables (ablate.api.kv.PagedKV).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ablate.api import (BuildContext, KVBudgetConfig, KVCache, PagedKV, Sequence, Stat, StepInputs, budget_bytes,
                        device_tensor)
from ablate_kv_cache.block_manager import BlockManager
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
        Stat("kv_block_bytes", "bytes per block", "bytes"),
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
        self.block_bytes = bs * s.bytes_per_token
        self.blocks_per_seq = blocks_per_seq = -(-s.max_seq_len // bs)
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
        self.k = torch.zeros(s.num_layers, num_blocks, bs, s.n_kv_heads, s.k_head_dim, dtype=s.dtype, device=s.device)
        self.v = torch.zeros(s.num_layers, num_blocks, bs, s.n_kv_heads, s.v_head_dim, dtype=s.dtype, device=s.device)
        # stats
        self.max_seqs_admitted = 0
        self.blocks_used_peak = 0
        self._frag_slots: list[int] = []           # per step: unused slots in the stepped sequences' blocks
        self._frag_slots_per_seq: list[float] = []
        self._lengths_admitted: dict[int, tuple[int, int]] = {}   # seq_id -> (prompt, max output), for predictions

    # -- room --------------------------------------------------------------------------------------
    def num_cached_tokens(self, seq: Sequence) -> int:
        return self.manager.cached_prefix(seq.token_ids)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        manager = self.manager
        if seq.seq_id not in manager.block_tables:     # admission: its first num_computed tokens are prefix hits
            if not manager.can_allocate(seq.token_ids, num_tokens, seq.num_computed_tokens):
                return False
            manager.allocate(seq.seq_id, seq.token_ids, num_tokens, seq.num_computed_tokens)
            self.max_seqs_admitted = max(self.max_seqs_admitted, len(manager.block_tables))
            self._lengths_admitted.setdefault(seq.seq_id, (seq.num_prompt_tokens, seq.request.max_new_tokens))
        else:
            extra = num_tokens - manager.num_tokens[seq.seq_id]
            if extra > 0:
                if not manager.can_append(seq.seq_id, extra):
                    return False
                self._copy_blocks(manager.append(seq.seq_id, extra))
        self.blocks_used_peak = max(self.blocks_used_peak, manager.num_used_blocks)
        return True

    def keep(self, seq: Sequence, num_tokens: int) -> None:
        if self.manager.num_tokens[seq.seq_id] > num_tokens:     # drafts rejected: give their blocks back
            self.manager.truncate(seq.seq_id, num_tokens)
        self.manager.commit(seq.seq_id, seq.token_ids, num_tokens)     # prefix caching: register full blocks

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)

    def num_seqs_admitted(self) -> int:
        return len(self.manager.block_tables)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a shared, partly-filled block becomes this sequence's own before it writes."""
        for src, dst in copies:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> None:
        bs, manager = self.block_size, self.manager
        tables = [manager.block_table(seq.seq_id) for seq in step.seqs]
        self._frag_slots.append(sum(len(t) * bs - ctx for t, ctx in zip(tables, step.context_lens)))
        self._frag_slots_per_seq.append(self._frag_slots[-1] / len(tables))
        # every table as wide as the longest sequence can need, so a step's shapes depend on its
        # batch size only (a captured decode graph replays for any lengths); padding entries point
        # at block 0: never read inside a context, masked outside it
        width = self.blocks_per_seq
        # slot of the token at position p: its block's physical index * block_size + p % block_size
        slots = [table[p // bs] * bs + p % bs
                 for table, n, end in zip(tables, step.query_lens, step.context_lens) for p in range(end - n, end)]
        device = self.spec.device
        step.plan["block_tables"] = device_tensor([t + [0] * (width - len(t)) for t in tables], torch.int32,
                                                  device)                                      # (B, width)
        step.plan["slot_mapping"] = device_tensor(slots, torch.long, device)                  # (T,)

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> slots of the flattened (num_blocks * block_size, H_kv, D) pool (flatten,
        # not view(-1, ...): MLA's V has zero width, and -1 cannot be inferred from zero elements)
        slots = step.plan["slot_mapping"]
        self.k[layer].flatten(0, 1).index_copy_(0, slots, k)
        self.v[layer].flatten(0, 1).index_copy_(0, slots, v)

    def view(self, layer: int, step: StepInputs) -> PagedKV:
        return PagedKV(self.k[layer], self.v[layer], step.plan["block_tables"])

    # -- memory ------------------------------------------------------------------------------------
    def bytes_reserved(self) -> int:
        # The blocks sequences hold, not the pool: the pool is allocated up front only so that no
        # allocation happens while serving, and a free block belongs to no sequence (any sequence
        # may claim it next step), like free memory in an allocator. What is reserved *for
        # sequences* is their blocks, so used / reserved measures the waste paging leaves: the
        # unfilled tail of each last block. The pool's size is reported as kv_pool_bytes.
        return self.manager.num_used_blocks * self.block_bytes

    def bytes_used(self) -> int:
        """Live tokens x bytes per token, a slot shared by several sequences counted once."""
        tables = self.manager.block_tables
        if sum(len(t) for t in tables.values()) == self.manager.num_used_blocks:   # nothing shared
            return super().bytes_used()
        filled: dict[int, int] = {}
        for seq_id, length in self.num_committed().items():
            for i, block_id in enumerate(tables.get(seq_id, ())):
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
                             manager.num_blocks * self.block_size, self.spec.max_num_seqs)
        return {
            "kv_block_size": self.block_size,
            "kv_block_bytes": self.block_bytes,
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
