"""Single-token decode attention over a paged KV cache (vLLM-style block tables), in Triton.

The cache is a pool of fixed-size physical blocks; a sequence's keys at logical position p live in
physical block block_tables[b, p // block_size], slot p % block_size. The kernel walks the sequence's
positions in tiles of BLOCK_N keys (a tile may span several blocks, or part of one): for each key of
the tile it looks up the physical block in the block table and gathers that key's (D,) row, so the
tile size is independent of the page size. The softmax is the online (running max / running sum)
form described in online_softmax.py, and long contexts are split across programs (flash-decoding)
and merged by the same combine kernel as flash_attention_decode.

CUDA graphs: paged_decode_attention can be captured into a torch.cuda.CUDAGraph. Its host side reads
only tensor shapes, dtypes, devices and strides, never values (no device sync), so the grid, the split
count and the scratch buffers depend on shapes alone; block_tables and context_lens are read on the
device and may change value between replays. Call it once with the same shapes before capturing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (_block_h, _check_float_inputs, _check_head_dim, _check_heads, _check_index, _check_tensor,
                     _decode_config, _dot_flags, _keys_per_split, _launch_decode_combine, _num_splits,
                     _require_runnable, _resolve_scale, _split_buffers)
from .online_softmax import _LOG2E, _dot, _online_softmax_step, _store_decode_result

__all__ = ["paged_decode_attention"]


# Integers that follow the cache / block-table shape or the split count are not specialised (no compiled
# variant per divisibility by 16), so changing batch sizes reuse the same compiled kernel.
@triton.jit(do_not_specialize=["stride_btb", "stride_mlb", "stride_mlh", "max_keys", "keys_per_split"])
def _paged_decode_kernel(
    Q, K_cache, V_cache, Block_tables, Ctx, O, Mid_O, Mid_LSE, qk_scale,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_btb,
    stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    max_keys, keys_per_split,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one sequence, one KV head (all GROUP query heads sharing it), one key split.

    Grid (B, H_kv, num_splits); the query heads of a group are the rows of one (BLOCK_H, D) tile, so
    every gathered K/V row is read once per group (see _flash_decode_kernel).
    """
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.minimum(tl.load(Ctx + b), max_keys)  # never index past the block table's row
    n_lo = split * keys_per_split
    if SPLIT:
        if n_lo >= ctx:
            return  # _combine_splits_kernel ignores splits past the context
    n_hi = tl.minimum(n_lo + keys_per_split, ctx)

    offs_h = tl.arange(0, BLOCK_H)  # (BLOCK_H,) query head within the group
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    head_mask = offs_h < GROUP
    head0 = kv_h * GROUP
    q_ptrs = Q + b * stride_qb + (head0 + offs_h[:, None]) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)  # (BLOCK_H, D)
    table_row = Block_tables + b * stride_btb
    k_head = K_cache + kv_h * stride_kh
    v_head = V_cache + kv_h * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        pos = start_n + offs_n  # (BLOCK_N,) logical key positions
        in_ctx = pos < n_hi
        # logical block -> physical block, then the key's slot inside it (int64: the pool can be big)
        phys = tl.load(table_row + pos // PAGE_SIZE, mask=in_ctx, other=0).to(tl.int64)  # (BLOCK_N,)
        slot = (pos % PAGE_SIZE).to(tl.int64)  # (BLOCK_N,)
        k_rows = k_head + phys * stride_kn + slot * stride_ks  # (BLOCK_N,) row pointers
        v_rows = v_head + phys * stride_vn + slot * stride_vs
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)  # (BLOCK_N, D)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST, PRECISION)
        s = tl.where(in_ctx[None, :], s, float("-inf"))  # (BLOCK_H, BLOCK_N) raw scores
        # every tile holds at least one key in the context, so no row is ever fully masked
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, False, DOT_UPCAST, PRECISION)

    _store_decode_result(acc, l_i, m_i, O, Mid_O, Mid_LSE, b, head0, split, offs_h, offs_d, head_mask,
                         stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, SPLIT)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None):
    """Single-token decode attention reading K/V through a block table.

    q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, H_kv, D), same dtype as q (fp16, bf16 or
    fp32), last-dim stride 1; block_tables: int32 (B, max_blocks_per_seq); context_lens: int32 (B,).
    Key p of sequence b is k_cache[block_tables[b, p // block_size], p % block_size]. Context lengths
    above max_blocks_per_seq * block_size are clamped to it; a context of 0 outputs zeros. Block-table
    entries past a sequence's context are never read; those inside it are not range-checked (that
    would need a device sync). Returns (B, H, D) in q's dtype.
    """
    _check_tensor("q", q, 3, "(B, H, D)")
    _check_tensor("k_cache", k_cache, 4, "(num_blocks, block_size, H_kv, D)")
    _check_tensor("v_cache", v_cache, 4, "(num_blocks, block_size, H_kv, D)")
    _check_float_inputs(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    batch, num_heads, head_dim = q.shape
    _check_head_dim("q", head_dim)
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} (same as q), got shape {tuple(k_cache.shape)}")
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache: expected block_size >= 1, got shape {tuple(k_cache.shape)}")
    group = _check_heads(num_heads, k_cache.shape[2], "k_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (same as k_cache), "
                         f"got {tuple(v_cache.shape)}")
    _check_index("block_tables", block_tables, 2, "(B, max_blocks_per_seq)", q.device)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected {batch} rows (one per sequence of q), got shape "
                         f"{tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected the last dimension to have stride 1, got strides "
                         f"{tuple(block_tables.stride())}")
    _check_index("context_lens", context_lens, 1, "(B,)", q.device)
    if context_lens.shape[0] != batch:
        raise ValueError(f"context_lens: expected shape ({batch},) to match q, got {tuple(context_lens.shape)}")
    scale = _resolve_scale(sm_scale, head_dim)
    _require_runnable("paged_decode_attention", q.device, "ablate_kernels.reference.paged_decode_attention_ref")

    config = _decode_config(head_dim, q.dtype)
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    num_splits = _num_splits(batch * k_cache.shape[2], max_keys, config["BLOCK_N"], q.device)
    return _launch_paged(q, k_cache, v_cache, block_tables, context_lens, group, scale, num_splits, config)


def _launch_paged(q, k_cache, v_cache, block_tables, context_lens, group, scale, num_splits, config):
    """Launch with an explicit split count and tile config (tests use it to cover both paths)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_keys = block_tables.shape[1] * block_size
    out = torch.empty(batch, num_heads, head_dim, device=q.device, dtype=q.dtype)  # (B, H, D)
    if batch == 0:
        return out
    keys_per_split = _keys_per_split(max_keys, num_splits, config["BLOCK_N"])  # whole key tiles per split
    mid_o, mid_lse, mo_strides, ml_strides = _split_buffers(q, out, num_splits)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, mid_o, mid_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *mo_strides, *ml_strides,
        max_keys, keys_per_split,
        PAGE_SIZE=block_size, GROUP=group, BLOCK_H=_block_h(group), HEAD_DIM=head_dim, SPLIT=num_splits > 1,
        **_dot_flags(q.dtype), **config,
    )
    if num_splits > 1:
        _launch_decode_combine(mid_o, mid_lse, context_lens, out, max_keys, keys_per_split, num_splits, head_dim)
    return out
