"""Single-token decode attention over a padded KV cache (flash-decoding), in Triton.

One program handles one sequence, one KV head (all the query heads sharing it) and one key split;
long contexts with few sequences are split across programs and the partial results merged by the
combine kernel of online_softmax.py (shared with paged_attention.py). Input checks and launch
configuration are in launch.py.

CUDA graphs: flash_attention_decode and paged_decode_attention can be captured into a
torch.cuda.CUDAGraph. Their host side reads only tensor shapes, dtypes, devices and strides (no
.item(), .tolist(), .cpu(), bool(tensor), nonzero() or other device sync), so the grid, the split
count and the scratch buffers depend on shapes alone, and context_lens (read on the device) may
change value between replays. Call them once with the same shapes before capturing, so that Triton
compiles outside the capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (_block_h, _check_float_inputs, _check_head_dim, _check_heads, _check_index, _check_tensor,
                     _decode_config, _dot_flags, _keys_per_split, _launch_decode_combine, _num_splits,
                     _require_runnable, _resolve_scale, _split_buffers)
from .online_softmax import _LOG2E, _dot, _online_softmax_step, _store_decode_result

__all__ = ["flash_attention_decode"]


# max_keys follows the padded cache length and stride_mlb / stride_mlh the split count: not specialised
# (no compiled variant per divisibility by 16), so changing batch sizes reuse the same compiled kernel.
@triton.jit(do_not_specialize=["stride_mlb", "stride_mlh", "max_keys", "keys_per_split"])
def _flash_decode_kernel(
    Q, K, V, Ctx, O, Mid_O, Mid_LSE, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    max_keys, keys_per_split,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one sequence, one KV head (all GROUP query heads sharing it), one key split.

    Grid (B, H_kv, num_splits). The GROUP query heads form the rows of a (BLOCK_H, D) tile, so each
    K/V tile is read from memory once per group, and the scores are a tensor-core dot; BLOCK_H is GROUP
    rounded up to a power of two >= 16 (the minimum dot size), the padding rows are masked.
    """
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.minimum(tl.load(Ctx + b), max_keys)  # never read past the padded length
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
    k_base = K + b.to(tl.int64) * stride_kb + kv_h * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_kn = start_n + offs_n  # (BLOCK_N,) key positions
        in_ctx = offs_kn < n_hi
        k = tl.load(k_base + offs_kn[:, None].to(tl.int64) * stride_ks + offs_d[None, :],
                    mask=in_ctx[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_base + offs_kn[:, None].to(tl.int64) * stride_vs + offs_d[None, :],
                    mask=in_ctx[:, None], other=0.0)  # (BLOCK_N, D)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST, PRECISION)
        s = tl.where(in_ctx[None, :], s, float("-inf"))  # (BLOCK_H, BLOCK_N) raw scores
        # every tile holds at least one key in the context, so no row is ever fully masked
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, False, DOT_UPCAST, PRECISION)

    _store_decode_result(acc, l_i, m_i, O, Mid_O, Mid_LSE, b, head0, split, offs_h, offs_d, head_mask,
                         stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, SPLIT)


def flash_attention_decode(q, k, v, context_lens, sm_scale=None):
    """Single-token decode attention over a padded KV cache.

    q: (B, H, D); k, v: (B, S_max, H_kv, D) (may be non-contiguous views, last-dim stride 1);
    context_lens: int32 (B,), keys at positions >= context_lens[b] are ignored (values above S_max are
    clamped to S_max; a sequence with context 0 outputs zeros). Splits the keys across programs
    (flash-decoding) when batch x KV heads is too small to fill the GPU. Returns (B, H, D) in q's dtype.
    """
    _check_tensor("q", q, 3, "(B, H, D)")
    _check_tensor("k", k, 4, "(B, S_max, H_kv, D)")
    _check_tensor("v", v, 4, "(B, S_max, H_kv, D)")
    _check_float_inputs(("q", "k", "v"), (q, k, v))
    batch, num_heads, head_dim = q.shape
    _check_head_dim("q", head_dim)
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k: expected shape ({batch}, S_max, H_kv, {head_dim}) to match q, got {tuple(k.shape)}")
    group = _check_heads(num_heads, k.shape[2], "k")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (same as k), got {tuple(v.shape)}")
    _check_index("context_lens", context_lens, 1, "(B,)", q.device)
    if context_lens.shape[0] != batch:
        raise ValueError(f"context_lens: expected shape ({batch},) to match q, got {tuple(context_lens.shape)}")
    scale = _resolve_scale(sm_scale, head_dim)
    _require_runnable("flash_attention_decode", q.device, "ablate_kernels.reference.flash_attention_decode_ref")

    config = _decode_config(head_dim, q.dtype)
    num_splits = _num_splits(batch * k.shape[2], k.shape[1], config["BLOCK_N"], q.device)
    return _launch_decode(q, k, v, context_lens, group, scale, num_splits, config)


def _launch_decode(q, k, v, context_lens, group, scale, num_splits, config):
    batch, num_heads, head_dim = q.shape
    max_keys, num_kv_heads = k.shape[1], k.shape[2]
    out = torch.empty(batch, num_heads, head_dim, device=q.device, dtype=q.dtype)  # (B, H, D)
    if batch == 0:
        return out
    keys_per_split = _keys_per_split(max_keys, num_splits, config["BLOCK_N"])  # whole key tiles per split
    mid_o, mid_lse, mo_strides, ml_strides = _split_buffers(q, out, num_splits)
    _flash_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, context_lens, out, mid_o, mid_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), *mo_strides, *ml_strides,
        max_keys, keys_per_split,
        GROUP=group, BLOCK_H=_block_h(group), HEAD_DIM=head_dim, SPLIT=num_splits > 1, **_dot_flags(q.dtype),
        **config,
    )
    if num_splits > 1:
        _launch_decode_combine(mid_o, mid_lse, context_lens, out, max_keys, keys_per_split, num_splits, head_dim)
    return out
