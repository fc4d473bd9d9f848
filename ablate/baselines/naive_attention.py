"""attention=naive: materialise the (queries x keys) score matrix, softmax in fp32; sliding windows
(in the mask) and soft-capped scores (Gemma 2) for the layers that have them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ablate.api import (Attention, KVView, LayerAttention, PluginConfig, StepInputs, causal_mask, pad_queries,
                        unpad_queries)


@dataclass
class NaiveAttentionConfig(PluginConfig):
    name: str = "naive"


class NaiveAttention(Attention):
    name = "naive"
    config_class = NaiveAttentionConfig
    graph_safe = True     # view.padded and causal_mask read a captured step's lengths from kv_lens_t
    features = frozenset({"sliding_window", "softcap"})
    reads_key_rings = True   # causal_mask(..., view.ring)

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs,
                 layer: LayerAttention | None = None) -> torch.Tensor:
        k, v = view.padded(step)                                   # (B, S, H_kv, D)
        qp = pad_queries(q, step)                                  # (B, Lq, H, D)
        b, lq, h, d = qp.shape
        h_kv, dv = k.shape[2], v.shape[-1]
        g = h // h_kv
        # group query heads by the KV head they share: no repeated K/V in memory
        qg = qp.view(b, lq, h_kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, g * lq, d)  # (B, H_kv, G*Lq, D)
        scores = qg.float() @ k.permute(0, 2, 3, 1).float()       # (B, H_kv, G*Lq, S)
        scores = scores.view(b, h_kv, g, lq, -1) * (1.0 / math.sqrt(d))
        if layer is not None and layer.softcap is not None:       # c tanh(s / c), before the mask
            scores = layer.softcap * torch.tanh(scores / layer.softcap)
        # (B, Lq, S); a windowed layer's view may be a ring of rows: masked by each key's position
        mask = causal_mask(step, k.shape[1], layer.window if layer is not None else None, view.ring)
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, h_kv, g * lq, -1)
        out = probs @ v.permute(0, 2, 1, 3).float()                # (B, H_kv, G*Lq, D_v)
        out = out.view(b, h_kv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(b, lq, h, dv)
        return unpad_queries(out.to(q.dtype), step)                # (T, H, D_v)
