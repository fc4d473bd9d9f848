"""Helpers for attention plugins: packed <-> padded queries, and the causal mask over a view's keys."""
from __future__ import annotations

import torch

from ablate.api.step import StepInputs, device_tensor


def causal_mask(step: StepInputs, num_keys: int | None = None) -> torch.Tensor:
    """(B, Lq, S) True where query i of sequence b may see key j; S = num_keys, the width of the keys
    attention reads (view.padded's), by default the step's longest kv_len.

    Aligned at the end: with L = kv_lens[b] keys and q = query_lens[b] queries, query i sees keys
    j <= L - q + i, and only keys that exist (j < L). Padded query rows see every real key (no NaNs).
    In a decode step captured for replay (step.graphed) the mask is built from kv_lens_t alone: pass
    num_keys, since the step's lists hold the lengths of the step it was captured on.
    """
    s = num_keys if num_keys is not None else step.max_kv_len

    def make():
        device = step.input_ids.device
        kv = step.kv_lens_t.long()                                         # (B,)
        j = torch.arange(s, device=device)                                 # (S,)
        if step.graphed:                                                   # one query, the sequence's last
            return (j[None, :] < kv[:, None])[:, None, :]                  # (B, 1, S)
        qlen = device_tensor(step.query_lens, torch.long, device)          # (B,)
        i = torch.arange(step.max_query_len, device=device)                # (Lq,)
        last = (kv - qlen)[:, None] + i[None, :]                           # (B, Lq): last key each query sees
        return (j[None, None, :] <= last[:, :, None]) & (j[None, None, :] < kv[:, None, None])
    return step.memo(f"causal_mask/{s}", make)


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
