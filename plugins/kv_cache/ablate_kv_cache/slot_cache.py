"""Shared by contiguous and dynamic: each sequence owns one row (slot) of a dense buffer.

Writes go through one flat index per step (slot * capacity + position, as nano-vllm's slot
mapping), so a step that mixes prefill chunks and decode tokens is one index_copy_ per layer.
Reads hand attention the batch's rows: a free view when their slots are consecutive.

A layer with a sliding window keeps only its window: a ring of R rows per sequence (KVSpec.ring_rows,
R = window - 1 + the most tokens a sequence feeds in one step), position p at row p mod R, read as
PaddedKV(..., ring=R), which attention masks by each row's position (ablate.api.causal_mask). Why
R rows suffice, rejected drafts included: with C tokens committed before a step that feeds n <= T
tokens (positions C .. C + n - 1), the step's queries need positions > C - W. A ring row holds the
latest position written to it; rows whose position is in C .. C + n - 1 are written by this step,
and a row whose latest committed position p < C was overwritten since only by a position p' = p +
kR that no step kept (a rejected draft). Drafts are fed within one step, at positions < C_prev + T
where C_prev <= C is where that step started, so p = p' - kR < C + T - R = C - W + 1: p was
already outside the window of every query from C on, and a row the mask counts holds what it says.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ablate.api import (BuildContext, KVBudgetConfig, KVCache, KVSpec, PaddedKV, PluginError, RowBuffers, Sequence,
                        Stat, StepInputs, budget_bytes, free_memory_bytes)


def check_pool_fits(cache: str, pool_bytes: int, seq_bytes: int, spec: KVSpec, config: KVBudgetConfig,
                    budget: int) -> None:
    """Before a cache allocates its pool (`seq_bytes` per sequence of spec.max_seq_len tokens; `budget`:
    the config's budget in bytes, 0: none): a ValueError naming the options to change if the pool
    exceeds the memory free on the device."""
    free = free_memory_bytes(spec.device)
    if pool_bytes <= free:
        return
    where = f"on {spec.device}" if spec.device.type == "cuda" else "in RAM"
    fit = free // seq_bytes
    if budget and pool_bytes < spec.max_num_seqs * seq_bytes:     # the budget, not max_num_seqs, sized it
        option = (f"kv_cache.budget_fraction={config.budget_fraction} ({budget} bytes)" if config.budget_fraction
                  else f"kv_cache.budget_bytes={budget}")
        raise ValueError(
            f"kv_cache={cache}: the KV budget {option} makes a pool of {pool_bytes} bytes, more than the "
            f"{free} bytes free {where}: lower the budget below {free} bytes (kv_cache.budget_bytes, or "
            f"kv_cache.budget_fraction: a share of the free memory)")
    raise ValueError(
        f"kv_cache={cache}: the KV pool for engine.max_num_seqs={spec.max_num_seqs} sequences of "
        f"{spec.max_seq_len} tokens (engine.max_seq_len, or the workload's longest prompt + output) at "
        f"{spec.bytes_per_token} bytes per token needs {pool_bytes} bytes, more than the {free} bytes free {where}. "
        + (f"{fit} such sequences fit: lower engine.max_num_seqs to {fit} or below, " if fit else
           "Not even one such sequence fits: ")
        + "shorten the sequences (engine.max_seq_len, the workload's lengths), or cap the pool with "
          "kv_cache.budget_bytes or kv_cache.budget_fraction (a share of the free memory, e.g. 0.9)")


@dataclass
class SlotCacheConfig(KVBudgetConfig):
    """The budget (bytes or a fraction of free memory) caps the slots x capacity buffer."""


class SlotKVCache(RowBuffers, KVCache):
    graph_safe = True     # the plan (write index, rows, storage) is all in step.plan (ablate/api/rows.py)
    reported_stats = (
        Stat("kv_slots", "rows of the buffer (sequences it can hold)", "count"),
        Stat("kv_capacity_tokens", "tokens per row", "tokens"),
        Stat("kv_ring_rows", "rows a windowed layer keeps per sequence (0: no layer keeps a ring)", "tokens"),
        Stat("kv_peak_reserved_bytes", "largest buffer held", "bytes"),
        Stat("max_seqs_admitted", "most sequences holding a row at once", "count"),
        Stat("kv_frag_slots_per_seq_mean", "row capacity holding no token, per sequence and step (mean)", "tokens",
             table="KV cache"),
    )

    def __init__(self, config: SlotCacheConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.budget_bytes = budget_bytes(config, self.spec.device, self.spec.bytes_per_token)   # 0: no limit beyond the slots
        self.max_seqs_admitted = 0               # most sequences holding a slot at once
        self.lengths_admitted: dict[int, tuple[int, int]] = {}   # seq_id -> (prompt, max output), for predictions
        self._frag_slots_per_seq: list[float] = []   # per step: row capacity not holding a token, per sequence
        self.slot_of: dict[int, int] = {}
        self.free_slots: list[int] = []          # a heap: the lowest free slot first keeps rows together
        # the windowed layers a ring of `ring` rows keeps (ring_k, ring_v), the others a row of `capacity`
        # tokens (k, v); _where[layer]: (in the ring buffers, index in its buffers)
        spec = self.spec
        self.ring_layers = [layer for layer in range(spec.num_layers) if spec.ring_rows(layer) is not None]
        self.ring = max((spec.ring_rows(layer) for layer in self.ring_layers), default=0)
        full_layers = [layer for layer in range(spec.num_layers) if layer not in self.ring_layers]
        self._where = ({layer: (False, i) for i, layer in enumerate(full_layers)}
                       | {layer: (True, i) for i, layer in enumerate(self.ring_layers)})
        self.k = self.v = self.ring_k = self.ring_v = torch.empty(0, device=spec.device)
        self.peak_reserved = 0
        self._allocate(0, 0)

    # -- storage -----------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def _allocate(self, num_slots: int, capacity: int) -> None:
        """(Re)allocate to (full layers, slots, capacity, H_kv, D) and (windowed layers, slots, ring,
        H_kv, D), keeping what is stored (a ring keeps its size, so each position keeps its row)."""
        s = self.spec
        old_slots = self.k.shape[1] if self.k.dim() == 5 else 0

        def grown(old: torch.Tensor, layers: int, rows: int, width: int) -> torch.Tensor:
            new = torch.zeros(layers, num_slots, rows, s.n_kv_heads, width, dtype=s.dtype, device=s.device)
            if old.dim() == 5 and old.shape[1] and old.shape[2]:
                new[:, :old.shape[1], :old.shape[2]] = old
            return new

        full, ringed = s.num_layers - len(self.ring_layers), len(self.ring_layers)
        self.k, self.v = grown(self.k, full, capacity, s.k_head_dim), grown(self.v, full, capacity, s.v_head_dim)
        self.ring_k = grown(self.ring_k, ringed, self.ring, s.k_head_dim)
        self.ring_v = grown(self.ring_v, ringed, self.ring, s.v_head_dim)
        self.free_slots = sorted(set(self.free_slots) | set(range(old_slots, num_slots)))
        self.peak_reserved = max(self.peak_reserved, self.bytes_reserved())

    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.ring_k, self.ring_v))

    def bytes_per_slot(self, capacity: int) -> int:
        """One sequence's rows: `capacity` tokens in each full layer, the ring in each windowed one."""
        rows = (self.spec.num_layers - len(self.ring_layers)) * capacity + len(self.ring_layers) * self.ring
        return rows * self.spec.layer_bytes_per_token

    def bytes_used(self) -> int:
        """Every committed token in the full layers; in a windowed layer kept as a ring, the last
        `window` of them (what ModelConfig.kv_bytes_at counts): the older rows are dead."""
        windows = [self.spec.windows[layer] for layer in self.ring_layers]
        full = self.spec.num_layers - len(windows)
        rows = sum(full * n + sum(min(n, w) for w in windows)
                   for n in (seq.num_computed_tokens for seq in self._held.values()))
        return rows * self.bytes_per_token // self.spec.num_layers     # the cache's own bytes (fp16, say)

    # -- room --------------------------------------------------------------------------------------
    def take_slot(self, seq: Sequence) -> None:
        self.slot_of[seq.seq_id] = heapq.heappop(self.free_slots)
        self.max_seqs_admitted = max(self.max_seqs_admitted, len(self.slot_of))
        self.lengths_admitted.setdefault(seq.seq_id, (seq.num_prompt_tokens, seq.request.max_new_tokens))

    def num_seqs_admitted(self) -> int:
        return len(self.slot_of)

    def free(self, seq: Sequence) -> None:
        heapq.heappush(self.free_slots, self.slot_of.pop(seq.seq_id))

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> None:
        self._frag_slots_per_seq.append(self.capacity - sum(step.context_lens) / len(step.context_lens))
        slots = [self.slot_of[s.seq_id] for s in step.seqs]
        self.plan_rows(slots, step, [0] * len(slots))
        if self.ring:
            self._plan_ring(step)

    def _plan_ring(self, step: StepInputs) -> None:
        """step.plan's `ring_write_index` (T,): token at position p of the sequence in slot s goes to row
        s * ring + p mod ring of the flattened ring buffers, derived on the device from `write_index`
        (s * capacity + p: plan_rows). The ring holds what a step needs only when no sequence feeds more
        tokens than the ring was sized for (the module's docstring)."""
        most = self.spec.max_step_tokens or self.spec.max_seq_len
        if max(step.query_lens) > most:
            raise PluginError(self, "prepare", f"a sequence feeds {max(step.query_lens)} tokens in one step, more "
                              f"than the {most} the windowed layers' rings were sized for (engine.max_num_batched_"
                              f"tokens, and speculative decoding's drafts + 1 within it): raise "
                              f"engine.max_num_batched_tokens to at least {max(step.query_lens)}")
        rows = step.plan["write_index"]                                            # (T,) s * capacity + p
        step.plan["ring_write_index"] = rows // self.capacity * self.ring + rows % self.capacity % self.ring
        step.plan["ring_storage"] = (self.ring_k.data_ptr(), tuple(self.ring_k.shape))   # a captured graph's address

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> rows of the flattened (slots * rows, H_kv, D) buffers of the layer's kind
        in_ring, i = self._where[layer]
        keys, values, index = ((self.ring_k, self.ring_v, step.plan["ring_write_index"]) if in_ring
                               else (self.k, self.v, step.plan["write_index"]))
        keys[i].flatten(0, 1).index_copy_(0, index, k)
        values[i].flatten(0, 1).index_copy_(0, index, v)

    def view(self, layer: int, step: StepInputs) -> PaddedKV:
        rows = step.plan["read_rows"]
        in_ring, i = self._where[layer]
        if in_ring:
            return PaddedKV(self.ring_k[i][rows], self.ring_v[i][rows], ring=self.ring)   # (B, ring, H_kv, D)
        return PaddedKV(self.k[i][rows], self.v[i][rows])                               # (B, capacity, H_kv, D)

    def stats(self) -> dict[str, float]:
        return {"kv_slots": self.num_slots, "kv_capacity_tokens": self.capacity, "kv_ring_rows": self.ring,
                "kv_peak_reserved_bytes": self.peak_reserved, "max_seqs_admitted": self.max_seqs_admitted,
                "kv_frag_slots_per_seq_mean": float(np.mean(self._frag_slots_per_seq)) if self._frag_slots_per_seq
                else float("nan")}
