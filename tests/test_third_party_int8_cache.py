"""A third party's KV cache, written against the plugin contract as it stood before the architecture
step (ablate.api of 7dbd9a7: KVCache, KVBudgetConfig, RowBuffers, QualityBound, Stat), passes the
conformance kit unchanged: K and V stored as int8 with one fp32 scale per token and head, planned
with RowBuffers' rows and dequantised for attention in view()."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api import KVBudgetConfig, KVCache, PaddedKV, QualityBound, RowBuffers, Stat, StepInputs, budget_bytes


@dataclass
class Int8Config(KVBudgetConfig):
    name: str = "int8"


class Int8KVCache(RowBuffers, KVCache):
    """One row per sequence slot, as the contiguous cache, in int8: x ~ scale * round(x / scale), the
    scale max|x| / 127 per token and head (absmax)."""

    name = "int8"
    config_class = Int8Config
    exact = False
    quality = QualityBound(max_ratio=1.05, num_tokens=64)
    reported_stats = (Stat("slots", "rows of the buffer", "count"),)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        s = self.spec
        budget = budget_bytes(config, s.device, self.bytes_per_token)
        row = s.max_seq_len * self.bytes_per_token
        slots = min(s.max_num_seqs, budget // row) if budget else s.max_num_seqs
        shape = (s.num_layers, slots, s.max_seq_len, s.n_kv_heads)
        self.k = torch.zeros(*shape, s.k_head_dim, dtype=torch.int8, device=s.device)    # RowBuffers' buffers
        self.v = torch.zeros(*shape, s.v_head_dim, dtype=torch.int8, device=s.device)
        self.k_scale = torch.zeros(*shape, 1, dtype=torch.float32, device=s.device)
        self.v_scale = torch.zeros(*shape, 1, dtype=torch.float32, device=s.device)
        self.free_slots = list(range(slots))
        self.slot_of: dict[int, int] = {}

    @property
    def bytes_per_token(self) -> int:
        s = self.spec        # one byte per element, and a 4-byte scale per head for K and for V
        return s.num_layers * s.n_kv_heads * (s.k_head_dim + s.v_head_dim + 8)

    def reserve(self, seq, num_tokens):
        if seq.seq_id not in self.slot_of:
            if not self.free_slots:
                return False
            self.slot_of[seq.seq_id] = self.free_slots.pop()
        return num_tokens <= self.capacity

    def free(self, seq):
        self.free_slots.append(self.slot_of.pop(seq.seq_id))

    def prepare(self, step: StepInputs):
        self.plan_rows([self.slot_of[s.seq_id] for s in step.seqs], step, [0] * step.num_seqs)

    def write(self, layer, step, k, v):
        index = step.plan["write_index"]
        for values, store, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if values.shape[-1] == 0:           # MLA caches its latent rows as K alone: V has no width
                continue
            s = values.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127      # (T, H_kv, 1)
            store[layer].flatten(0, 1).index_copy_(0, index, (values.float() / s).round().to(torch.int8))
            scale[layer].flatten(0, 1).index_copy_(0, index, s)

    def view(self, layer, step):
        rows = step.plan["read_rows"]
        dtype = self.spec.dtype
        return PaddedKV((self.k[layer][rows].float() * self.k_scale[layer][rows]).to(dtype),
                        (self.v[layer][rows].float() * self.v_scale[layer][rows]).to(dtype))

    def bytes_reserved(self):
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))

    def stats(self):
        return {"slots": len(self.free_slots) + len(self.slot_of)}


def test_an_int8_cache_written_against_the_contract_passes_the_kit(ablate_registry, ablate_tiny_model):
    from ablate.testing import check_plugin

    check_plugin("kv_cache", "int8", ablate_registry.with_plugins(Int8KVCache), ablate_tiny_model)
