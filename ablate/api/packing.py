"""Helpers for attention plugins: packed <-> padded queries, the causal mask over a view's keys (with
a sliding window), what a layer's attention adds to the plain one (LayerAttention), and attention
with soft-capped scores."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ablate.api.step import StepInputs, device_tensor

SLIDING_WINDOW = "sliding_window"   # the names of the features an Attention plugin declares (Attention.features)
SOFTCAP = "softcap"


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes beyond softmax(q k^T / sqrt(D) + causal mask) v. The
    forward passes it (`attention(q, view, step, layer)`) only for a layer that needs a feature, and
    only to a plugin that declares that feature in Attention.features."""

    window: int | None = None      # the query at position p sees keys p - window + 1 .. p only (Mistral, Gemma)
    softcap: float | None = None   # scaled scores s -> softcap x tanh(s / softcap), before the mask (Gemma 2)

    @property
    def features(self) -> frozenset[str]:
        return frozenset([SLIDING_WINDOW] * (self.window is not None) + [SOFTCAP] * (self.softcap is not None))


def causal_mask(step: StepInputs, num_keys: int | None = None, window: int | None = None,
                ring: int = 0) -> torch.Tensor:
    """(B, Lq, S) True where query i of sequence b may see key j; S = num_keys, the width of the keys
    attention reads (view.padded's), by default the step's longest kv_len.

    Aligned at the end: with L = kv_lens[b] keys and q = query_lens[b] queries, query i sees keys
    j <= L - q + i, and only keys that exist (j < L). Padded query rows see every real key (no NaNs).
    With a window W it sees only keys j > L - q + i - W: W keys, itself included (transformers'
    sliding window). The window counts the view's keys, which are the positions for every cache
    that keeps all tokens (one that evicts, streaming, counts what it kept).
    ring = R > 0 (pass view.ring): the view keeps a windowed layer's keys in a ring of R rows
    (PaddedKV.ring), so key j is at position p_j = L - 1 - ((L - 1 - j) mod R), none when p_j < 0, and
    the rules above apply to p_j instead of j. Softmax is blind to the order of the keys, and RoPE
    was applied before they were stored, so only the mask needs their positions.
    In a decode step captured for replay (step.graphed) the mask is built from kv_lens_t alone: pass
    num_keys, since the step's lists hold the lengths of the step it was captured on.
    """
    if ring and (window is None or num_keys is None):
        raise ValueError("causal_mask: a ring of keys (ring > 0) needs the layer's window and num_keys")
    s = num_keys if num_keys is not None else step.max_kv_len

    def make():
        device = step.input_ids.device
        kv = step.kv_lens_t.long()                                         # (B,)
        j = torch.arange(s, device=device)                                 # (S,)
        if ring:                                                           # (B, S): each row's position
            pos = (kv - 1)[:, None] - ((kv - 1)[:, None] - j[None, :]).remainder(ring)
            exists = pos >= 0                                              # ring rows not written yet: < 0
        else:
            pos = j[None, :].expand(kv.shape[0], s)
            exists = pos < kv[:, None]
        if step.graphed:                                                   # one query, the sequence's last
            seen = exists
            if window is not None:
                seen = seen & (pos >= kv[:, None] - window)
            return seen[:, None, :]                                        # (B, 1, S)
        qlen = device_tensor(step.query_lens, torch.long, device)          # (B,)
        i = torch.arange(step.max_query_len, device=device)                # (Lq,)
        last = (kv - qlen)[:, None] + i[None, :]                           # (B, Lq): last key each query sees
        seen = (pos[:, None, :] <= last[:, :, None]) & exists[:, None, :]
        if window is not None:   # a padded row's last is past the keys: its window ends at the last key
            first = torch.minimum(last, (kv - 1)[:, None]) - window        # (B, Lq): keys after it are seen
            seen &= pos[:, None, :] > first[:, :, None]
        return seen
    return step.memo(f"causal_mask/{s}/{window}/{ring}", make)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         softcap: float) -> torch.Tensor:
    """softmax(c tanh(q k^T / (c sqrt(D))) + mask) v with c = softcap, in fp32 (SDPA cannot cap the
    scores). q (B, H, Lq, D); k, v (B, H_kv, S, D); mask (B, 1, Lq, S) bool or None -> (B, H, Lq, D_v)
    in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()                             # (B, H, S, D)
    v = v.repeat_interleave(groups, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))   # (B, H, Lq, S)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)                    # (B, H, Lq, D_v)


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
