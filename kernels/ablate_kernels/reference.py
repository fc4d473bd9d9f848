"""Readable pure-PyTorch references for the attention kernels.

They define what the Triton kernels must compute, and are the fallback where Triton cannot run (CPU
without TRITON_INTERPRET). Each materialises the full score matrix and takes the softmax in fp32, one
sequence at a time, so they are slow and memory hungry on long sequences, but obviously correct.
Signatures match the kernels; results are returned in q's dtype (pass fp32 inputs for an fp32 result).

Conventions shared with the kernels:
- grouped-query attention: query head h uses KV head h // (H / H_kv);
- causal masking is bottom-right aligned: with Lq queries and Lk keys, query i sits at absolute
  position Lk - Lq + i and sees keys 0..Lk - Lq + i;
- a query row that sees no key outputs zeros (instead of the NaN a softmax over nothing gives).
"""

from __future__ import annotations

import math

import torch

__all__ = ["flash_attention_varlen_ref", "flash_attention_decode_ref", "paged_decode_attention_ref"]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
            sm_scale: float) -> torch.Tensor:
    """softmax(sm_scale * q k^T) v in fp32 for one sequence.

    q: (Lq, H, D); k, v: (Lk, H_kv, D); visible: (Lq, Lk) bool or None (all visible). Returns (Lq, H, D) fp32.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    q = q.float().transpose(0, 1)  # (H, Lq, D)
    # repeat each KV head for the `group` query heads that share it (fine for a reference)
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, Lk, D)
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, Lk, D)
    scores = torch.matmul(q, k.transpose(1, 2)) * sm_scale  # (H, Lq, Lk)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (H, Lq, Lk)
    if visible is not None:
        # rows with no visible key: softmax of all -inf is NaN; define the output as 0
        probs = torch.where(visible.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    return torch.matmul(probs, v).transpose(0, 1)  # (Lq, H, D)


def _scale(sm_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def flash_attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               causal=True, sm_scale=None):
    """Reference for flash_attention_varlen. q: (T_q, H, D); k, v: (T_k, H_kv, D); cu_seqlens_*: (B+1,)."""
    scale = _scale(sm_scale, q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (T_q, H, D)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        seqlen_q, seqlen_k = q1 - q0, k1 - k0
        if seqlen_q == 0:
            continue
        key_pos = torch.arange(seqlen_k, device=q.device)  # (Lk,)
        if causal:
            query_pos = seqlen_k - seqlen_q + torch.arange(seqlen_q, device=q.device)  # (Lq,)
            visible = key_pos[None, :] <= query_pos[:, None]  # (Lq, Lk)
        else:
            visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)  # (Lq, Lk)
        out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], visible, scale)
    return out.to(q.dtype)


def flash_attention_decode_ref(q, k, v, context_lens, sm_scale=None):
    """Reference for flash_attention_decode. q: (B, H, D); k, v: (B, S_max, H_kv, D); context_lens: (B,)."""
    scale = _scale(sm_scale, q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, D)
    for b, ctx in enumerate(context_lens.tolist()):
        ctx = min(ctx, k.shape[1])
        if ctx > 0:
            out[b] = _attend(q[b:b + 1], k[b, :ctx], v[b, :ctx], None, scale)[0]
    return out.to(q.dtype)


def gather_paged_kv(cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first context_len tokens of one sequence from a paged cache, contiguous: (context_len, H_kv, D).

    cache: (num_blocks, block_size, H_kv, D); block_table_row: (max_blocks_per_seq,).
    """
    block_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)  # (L,)
    blocks = block_table_row.long()[pos // block_size]  # (L,) physical block of each position
    return cache[blocks, pos % block_size]  # (L, H_kv, D)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None):
    """Reference for paged_decode_attention. q: (B, H, D); caches: (num_blocks, block_size, H_kv, D)."""
    scale = _scale(sm_scale, q.shape[-1])
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, D)
    for b, ctx in enumerate(context_lens.tolist()):
        ctx = min(ctx, max_keys)
        if ctx > 0:
            k = gather_paged_kv(k_cache, block_tables[b], ctx)  # (ctx, H_kv, D)
            v = gather_paged_kv(v_cache, block_tables[b], ctx)  # (ctx, H_kv, D)
            out[b] = _attend(q[b:b + 1], k, v, None, scale)[0]
    return out.to(q.dtype)
