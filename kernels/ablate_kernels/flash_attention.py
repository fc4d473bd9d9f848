"""FlashAttention-2 style forward kernel in Triton for packed variable-length prefill.

The online-softmax maths is in online_softmax.py; input checks in launch.py; the tile configs and
their selection by timing in tuning.py. The padded decode kernel is in decode_attention.py
(flash_attention_decode is re-exported here).

flash_attention_varlen is not meant for CUDA graph capture: the first call of a length bucket
autotunes (timing runs that synchronise). The decode kernels are capturable (decode_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .decode_attention import flash_attention_decode
from .launch import (_check_float_inputs, _check_head_dim, _check_heads, _check_index, _check_tensor, _dot_flags,
                     _require_runnable, _resolve_scale, triton_available)
from .online_softmax import _LOG2E, _dot, _online_softmax_step

__all__ = ["flash_attention_varlen", "flash_attention_decode", "triton_available"]


# ----------------------------------------------------------------------------------------------
# Varlen prefill kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _varlen_key_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, n_lo, n_hi, seqlen_k, q_pos, qk_scale,
                      offs_n, offs_d, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Visit key tiles [n_lo, n_hi) of one sequence for one query tile.

    MASKED=False is the fast path for tiles that lie entirely inside the sequence and (causal) entirely
    at or below the diagonal for every query row of the tile: no bounds or causal mask needed.
    """
    for start_n in range(n_lo, n_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_kn = start_n + offs_n  # (BLOCK_N,) key positions within the sequence
        k_ptrs = k_base + offs_kn[:, None] * stride_kt + offs_d[None, :]  # (BLOCK_N, D)
        v_ptrs = v_base + offs_kn[:, None] * stride_vt + offs_d[None, :]  # (BLOCK_N, D)
        if MASKED:
            in_seq = offs_kn < seqlen_k  # (BLOCK_N,)
            k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_UPCAST, PRECISION)
        if MASKED:  # s: (BLOCK_M, BLOCK_N) raw scores, scaled inside _online_softmax_step
            visible = in_seq[None, :]  # (1, BLOCK_N)
            if CAUSAL:
                visible = visible & (offs_kn[None, :] <= q_pos[:, None])  # (BLOCK_M, BLOCK_N)
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, MASKED, DOT_UPCAST, PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q_bucket"])
def _flash_varlen_fwd_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    seqlen_q_bucket,  # unused by the kernel: the autotune key's length bucket (tuning.py)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one tile of BLOCK_M queries of one sequence and one query head.

    Grid (cdiv(max_seqlen_q, BLOCK_M), B, H). Tiles are visited last-first so that, under causal
    masking, the longest-running query tiles start earliest and the tail of the launch is short.
    """
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_start
    if pid_m * BLOCK_M >= seqlen_q:
        return
    k_start = tl.load(cu_seqlens_k + b)
    seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_start
    kv_h = h // GROUP  # GQA: query head h shares KV head h // (H / H_kv)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the sequence
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    q_ptrs = Q + (q_start.to(tl.int64) + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < seqlen_q, other=0.0)  # (BLOCK_M, D)
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_h * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_h * stride_vh

    # Bottom-right causal alignment: query i sits at absolute position seqlen_k - seqlen_q + i and
    # sees keys 0..that position (prefill, chunked prefill and verification with a KV prefix).
    q_pos = seqlen_k - seqlen_q + offs_m  # (BLOCK_M,)
    if CAUSAL:
        first_pos = seqlen_k - seqlen_q + pid_m * BLOCK_M  # position of the tile's first query
        n_hi = tl.minimum(seqlen_k, first_pos + BLOCK_M)  # keys past the last query are never visible
        # keys 0..first_pos are visible to every row of the tile: whole tiles there need no mask
        n_full = tl.maximum(tl.minimum(first_pos + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N
    else:
        n_hi = seqlen_k
        n_full = seqlen_k // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m) v
    acc, l_i, m_i = _varlen_key_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, n_full, seqlen_k,
                                      q_pos, qk_scale, offs_n, offs_d, False, CAUSAL, BLOCK_M, BLOCK_N, DOT_UPCAST,
                                      PRECISION)
    acc, l_i, m_i = _varlen_key_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, n_full, n_hi, seqlen_k,
                                      q_pos, qk_scale, offs_n, offs_d, True, CAUSAL, BLOCK_M, BLOCK_N, DOT_UPCAST,
                                      PRECISION)

    # Rows that saw no key (empty key sequence, or causal with more queries than keys) output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # (BLOCK_M, D)
    o_ptrs = O + (q_start.to(tl.int64) + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
                           sm_scale=None):
    """Attention over packed variable-length sequences (prefill, chunked prefill, verification).

    q: (T_q, H, D); k, v: (T_k, H_kv, D), same dtype (fp16, bf16 or fp32), last-dim stride 1.
    cu_seqlens_q, cu_seqlens_k: int32 (B+1,), cumulative starts (cu[0] == 0, cu[B] == T).
    max_seqlen_q must be >= every query length (rows past it are not computed); max_seqlen_k is
    accepted for API symmetry. Causal masking is bottom-right aligned: query i of a sequence with Lq
    queries and Lk keys is at position Lk - Lq + i and sees keys 0..Lk - Lq + i. Query rows that see
    no key (Lk == 0, or causal rows with Lq > Lk) output zeros. Returns (T_q, H, D) in q's dtype.
    The cu_seqlens values are not checked (that would need a device sync).
    """
    _check_tensor("q", q, 3, "(T_q, H, D)")
    _check_tensor("k", k, 3, "(T_k, H_kv, D)")
    _check_tensor("v", v, 3, "(T_k, H_kv, D)")
    _check_float_inputs(("q", "k", "v"), (q, k, v))
    total_q, num_heads, head_dim = q.shape
    _check_head_dim("q", head_dim)
    if k.shape[2] != head_dim:
        raise ValueError(f"k: expected head_dim {head_dim} (same as q), got shape {tuple(k.shape)}")
    group = _check_heads(num_heads, k.shape[1], "k")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (same as k), got {tuple(v.shape)}")
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, "(B+1,)", q.device)
    _check_index("cu_seqlens_k", cu_seqlens_k, 1, "(B+1,)", q.device)
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q: expected at least 2 entries (B+1 with B >= 1), got {cu_seqlens_q.shape[0]}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} (same as cu_seqlens_q), "
                         f"got {tuple(cu_seqlens_k.shape)}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    scale = _resolve_scale(sm_scale, head_dim)
    _require_runnable("flash_attention_varlen", q.device, "ablate_kernels.reference.flash_attention_varlen_ref")

    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T_q, H, D)
    if total_q == 0 or max_seqlen_q == 0:
        return out.zero_()
    return _launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, group, bool(causal), scale)


_VARLEN_TUNED = tuning.autotuners(_flash_varlen_fwd_kernel)  # {head-dim class: autotuner}; {} when interpreted


def _launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, group, causal, scale, config=None):
    """Launch the prefill kernel: with the timed choice for this shape (config None, see tuning.py),
    or with exactly `config` (tests cover GPU tile sizes with it, the benchmark times candidates)."""
    batch = cu_seqlens_q.shape[0] - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    bucket = tuning.seqlen_bucket(max_seqlen_q)
    launched, tiles, pick_key = tuning.select_prefill(_flash_varlen_fwd_kernel, _VARLEN_TUNED, head_dim, q.dtype,
                                                      causal, bucket, config)

    def grid(meta):  # BLOCK_M from the launch kwargs, or from the config the autotuner is running
        return (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), batch, num_heads)

    launched[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        bucket,
        GROUP=group, HEAD_DIM=head_dim, CAUSAL=causal, **_dot_flags(q.dtype), **tiles,
    )
    tuning.record_prefill(launched, tiles, pick_key)
    return out
