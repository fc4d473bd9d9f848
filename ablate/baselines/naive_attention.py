"""attention=naive: materialise the (queries x keys) score matrix, softmax in fp32."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ablate.api.step import StepInputs
from ablate.api.slots import Attention
from ablate.api.kv import KVView
from ablate.api.plugin import PluginConfig


@dataclass
class NaiveAttentionConfig(PluginConfig):
    name: str = "naive"


def causal_mask(step: StepInputs) -> torch.Tensor:
    """(B, Lq, S) True where query i of sequence b may see key j.

    Query i sits at absolute position p = context_len - query_len + i; it sees keys j <= p, and
    only keys that exist (j < context_len). Padded query rows see every real key (no NaNs).
    """
    def make():
        device = step.input_ids.device
        ctx = step.context_lens_t.long()                                   # (B,)
        qlen = torch.tensor(step.query_lens, device=device)                # (B,)
        i = torch.arange(step.max_query_len, device=device)                # (Lq,)
        j = torch.arange(step.max_context_len, device=device)              # (S,)
        pos = (ctx - qlen)[:, None] + i[None, :]                           # (B, Lq)
        return (j[None, None, :] <= pos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
    return step.memo("causal_mask", make)


def pad_queries(q: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """Packed (T, H, D) -> (B, Lq, H, D); a free view when every sequence has one query."""
    b, lq = step.num_seqs, step.max_query_len
    if step.is_decode:
        return q.view(b, 1, *q.shape[1:])
    rows, _ = step.query_pad_index()
    return q.new_zeros(b * lq, *q.shape[1:]).index_copy_(0, rows, q).view(b, lq, *q.shape[1:])


def unpad_queries(out: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """(B, Lq, H, D) -> packed (T, H, D)."""
    flat = out.reshape(-1, *out.shape[2:])
    if step.is_decode:
        return flat
    rows, _ = step.query_pad_index()
    return flat.index_select(0, rows)


class NaiveAttention(Attention):
    name = "naive"
    config_class = NaiveAttentionConfig

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        k, v = view.padded(step)                                   # (B, S, H_kv, D)
        qp = pad_queries(q, step)                                  # (B, Lq, H, D)
        b, lq, h, d = qp.shape
        h_kv = k.shape[2]
        g = h // h_kv
        # group query heads by the KV head they share: no repeated K/V in memory
        qg = qp.view(b, lq, h_kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, g * lq, d)  # (B, H_kv, G*Lq, D)
        scores = qg.float() @ k.permute(0, 2, 3, 1).float()       # (B, H_kv, G*Lq, S)
        scores = scores.view(b, h_kv, g, lq, -1) * (1.0 / math.sqrt(d))
        mask = causal_mask(step)                                   # (B, Lq, S)
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, h_kv, g * lq, -1)
        out = probs @ v.permute(0, 2, 1, 3).float()                # (B, H_kv, G*Lq, D)
        out = out.view(b, h_kv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, h, d)
        return unpad_queries(out.to(q.dtype), step)                # (T, H, D)
