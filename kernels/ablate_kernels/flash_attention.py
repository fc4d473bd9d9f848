"""FlashAttention-2 style forward kernels in Triton: packed variable-length prefill and padded decode.

The maths (shared by every kernel in this package)
--------------------------------------------------
For one query row q and keys k_1..k_N the output is

    o = sum_j softmax(s)_j v_j,    s_j = sm_scale * <q, k_j>

Keys are visited in tiles and never materialised as a full score row. The kernel keeps, per row,

    m  = running max of the scores seen so far        (starts at -inf)
    l  = running sum of exp(s_j - m)                  (starts at 0)
    acc = running sum of exp(s_j - m) v_j             (starts at 0, fp32)

and for every new tile of scores s_tile:

    m_new = max(m, max_j s_tile_j)
    alpha = exp(m - m_new)                 # rescales what was accumulated under the old max
    p_j   = exp(s_tile_j - m_new)
    l     = alpha * l + sum_j p_j
    acc   = alpha * acc + sum_j p_j v_j
    m     = m_new

At the end o = acc / l. Subtracting the running max keeps every exponent <= 0, so nothing overflows,
and the result is exactly the softmax (the common factor exp(m) cancels between acc and l).
We work in base 2: scores are pre-multiplied by log2(e) so exp(x) becomes exp2(x'), which maps to a
single hardware instruction. The log-sum-exp of a row (used to merge split-K partial results) is
lse = m + log2(l), also in base 2.

Grouped-query attention: query head h reads KV head h // (H / H_kv); K and V are never repeated.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

__all__ = ["flash_attention_varlen", "flash_attention_decode", "triton_available"]

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Shared device helpers (also used by paged_attention.py)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, DOT_UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    DOT_UPCAST is set only under TRITON_INTERPRET for bfloat16 inputs: the interpreter stores
    bf16 as raw uint16 and its tl.dot multiplies the bit patterns (triton issue #11584). Products of
    two bf16 values are exact in fp32, so upcasting gives the same result as a bf16 tensor-core dot.
    PRECISION is "ieee" for fp32 inputs (true fp32, no TF32 rounding) and "tf32" otherwise (ignored
    for 16-bit inputs).
    """
    if DOT_UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, GUARD_EMPTY: tl.constexpr, DOT_UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Fold one tile of scores into the running (acc, l, m) state; see the module docstring.

    s: (ROWS, COLS) scores already scaled to base 2, -inf where masked.  v: (COLS, D).
    GUARD_EMPTY: the tile may contain rows whose every score is -inf and that have seen no key yet
    (m stays -inf); subtract 0 instead of -inf for them so exp2 gives 0 rather than NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (ROWS,)
    if GUARD_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)  # (ROWS,) exp(m_old - m_new), 0 on the first tile
    p = tl.exp2(s - m_ref[:, None])  # (ROWS, COLS)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, DOT_UPCAST, PRECISION)  # (ROWS, D)
    return acc, l_i, m_new


@triton.jit
def _store_decode_result(acc, l_i, m_i, O, Mid_O, Mid_LSE, b, head0, split, offs_h, offs_d, head_mask,
                         stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                         SPLIT: tl.constexpr):
    """Write one decode program's result for the BLOCK_H query heads head0 + offs_h.

    Without splitting the normalised output goes straight to O in its dtype. With split-K the
    normalised partial output (fp32) and its log-sum-exp go to Mid_O / Mid_LSE for _combine_splits.
    A row that saw no key (empty context) has l == 0; it yields 0 and lse = -inf (weight 0).
    """
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # (BLOCK_H, D)
    heads = head0 + offs_h  # (BLOCK_H,)
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # (BLOCK_H,)
        mo_ptrs = Mid_O + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(mo_ptrs, out, mask=head_mask[:, None])
        tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + split, lse, mask=head_mask)
    else:
        o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=head_mask[:, None])


@triton.jit
def _combine_splits_kernel(
    Mid_O, Mid_LSE, Ctx, O,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    max_keys, keys_per_split,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Merge split-K partial results of one (sequence, query head).

    Split s covers a disjoint key range and produced o_s = acc_s / l_s and lse_s = m_s + log2(l_s).
    The full softmax over the union is o = sum_s w_s o_s / sum_s w_s with w_s = exp2(lse_s - max lse):
    w_s is l_s * exp(m_s) up to the common factor exp2(max lse).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.minimum(tl.load(Ctx + b), max_keys)  # clamped exactly as in the split kernels
    n_valid = tl.cdiv(ctx, keys_per_split)  # splits past the context wrote nothing
    offs_s = tl.arange(0, SPLITS_P2)  # (S,)
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    s_mask = (offs_s < n_valid) & (offs_s < NUM_SPLITS)
    lse = tl.load(Mid_LSE + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))  # (S,)
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context: all weights 0
    w = tl.exp2(lse - lse_max)  # (S,)
    o_ptrs = Mid_O + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :]
    o_parts = tl.load(o_ptrs, mask=s_mask[:, None], other=0.0)  # (S, D)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = tl.sum(o_parts * w[:, None], 0) / denom  # (D,)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


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
        s = s * qk_scale  # (BLOCK_M, BLOCK_N) scores in base-2 units
        if MASKED:
            visible = in_seq[None, :]  # (1, BLOCK_N)
            if CAUSAL:
                visible = visible & (offs_kn[None, :] <= q_pos[:, None])  # (BLOCK_M, BLOCK_N)
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, MASKED, DOT_UPCAST, PRECISION)
    return acc, l_i, m_i


@triton.jit
def _flash_varlen_fwd_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
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
# Padded decode kernel (one query per sequence)
# ----------------------------------------------------------------------------------------------


@triton.jit
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
        s = tl.where(in_ctx[None, :], s * qk_scale, float("-inf"))  # (BLOCK_H, BLOCK_N)
        # every tile holds at least one key in the context, so no row is ever fully masked
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, False, DOT_UPCAST, PRECISION)

    _store_decode_result(acc, l_i, m_i, O, Mid_O, Mid_LSE, b, head0, split, offs_h, offs_d, head_mask,
                         stride_ob, stride_oh, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, SPLIT)


# ----------------------------------------------------------------------------------------------
# Host side: availability, input checks, launch configuration
# ----------------------------------------------------------------------------------------------

# The kernels above were built by the interpreter iff TRITON_INTERPRET was set when this module (and
# triton.jit) ran; setting it later does not turn them into interpreted kernels.
_INTERPRETED = not isinstance(_flash_varlen_fwd_kernel, triton.runtime.JITFunction)


def triton_available(device) -> bool:
    """Whether these kernels can run on `device` (a torch.device, a device string or a tensor).

    True on CUDA when a GPU is present, and on CPU only when the kernels were imported under
    TRITON_INTERPRET=1 (the slow Triton interpreter, for tests).
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        return _INTERPRETED
    return False


def _require_runnable(fn_name: str, device: torch.device, fallback: str) -> None:
    if not triton_available(device):
        raise RuntimeError(
            f"{fn_name}: the Triton kernel cannot run on device '{device}': it needs a CUDA GPU, or "
            "TRITON_INTERPRET=1 set in the environment before triton / ablate_kernels are imported "
            f"(CPU interpreter, for tests only). Use {fallback} or "
            "torch.nn.functional.scaled_dot_product_attention instead."
        )


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {layout}, got shape {tuple(x.shape)}")


def _check_float_inputs(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Same float dtype, same device, unit stride on the head dim, for q/k/v-like tensors."""
    first_name, first = names[0], tensors[0]
    if first.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{first_name}: expected dtype float16, bfloat16 or float32, got {first.dtype}")
    for name, x in zip(names, tensors):
        if x.dtype != first.dtype:
            raise ValueError(f"{name}: expected dtype {first.dtype} (same as {first_name}), got {x.dtype}")
        if x.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (same as {first_name}), got {x.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last (head_dim) dimension to have stride 1, "
                             f"got strides {tuple(x.stride())}")


def _check_index(name: str, x, ndim: int, layout: str, device: torch.device) -> None:
    _check_tensor(name, x, ndim, layout)
    if x.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (same as q), got {x.device}")


def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"{name}: expected head_dim a power of two between 16 and 256, got {head_dim}")


def _check_heads(num_heads: int, num_kv_heads: int, kv_name: str) -> int:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{kv_name}: expected the number of KV heads to divide the number of query heads "
                         f"({num_heads}), got {num_kv_heads}")
    return num_heads // num_kv_heads


def _resolve_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected None or a positive finite float, got {sm_scale!r}")
    return float(sm_scale)


def _dot_flags(dtype: torch.dtype) -> dict:
    return {
        "DOT_UPCAST": _INTERPRETED and dtype == torch.bfloat16,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _varlen_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes for the prefill kernel (tuned for sm_80/sm_90 shared memory and registers)."""
    if _INTERPRETED:
        # small, unequal tiles so CPU tests cross several query and key tiles and the diagonal
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:  # fp32 is a correctness path (IEEE FMA dots), keep tiles small
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _decode_config(head_dim: int, dtype: torch.dtype) -> dict:
    if _INTERPRETED:
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim >= 256 or dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def _block_h(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(num_programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """How many key splits (flash-decoding) to use.

    Decode is memory bound: with few (sequence, KV head) programs the GPU's SMs sit idle, so the keys
    are split until there are ~4 programs per SM, while keeping >= 4 key tiles per split so that the
    extra combine pass stays cheap. Uses only host-side sizes (no device sync on context_lens).
    """
    if device.type == "cuda":
        sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sm_count = 4  # interpreter: a pretend GPU, so CPU tests also take the split path
    wanted = triton.cdiv(4 * sm_count, max(num_programs, 1))
    by_length = triton.cdiv(max_keys, 4 * block_n)
    return int(max(1, min(wanted, by_length, 64)))


def _launch_decode_combine(mid_o, mid_lse, context_lens, out, max_keys, keys_per_split, num_splits, head_dim):
    batch, num_heads = out.shape[0], out.shape[1]
    _combine_splits_kernel[(batch, num_heads)](
        mid_o, mid_lse, context_lens, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        max_keys, keys_per_split,
        NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        num_warps=4,
    )


def _split_buffers(q: torch.Tensor, out: torch.Tensor, num_splits: int):
    """fp32 scratch for split-K partial outputs (B, H, S, D) and their log-sum-exps (B, H, S).

    Without splitting the kernel never touches them; `out` stands in so no null pointer is passed.
    """
    batch, num_heads, head_dim = q.shape
    if num_splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)  # (B, H, S, D)
    mid_lse = torch.empty(batch, num_heads, num_splits, device=q.device, dtype=torch.float32)  # (B, H, S)
    return mid_o, mid_lse, mid_o.stride()[:3], mid_lse.stride()[:2]


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
    return _launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, group, bool(causal), scale,
                          _varlen_config(head_dim, q.dtype))


def _launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, group, causal, scale, config):
    """Launch the prefill kernel with an explicit tile config (tests use it to cover GPU tile sizes)."""
    batch = cu_seqlens_q.shape[0] - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), batch, num_heads)
    _flash_varlen_fwd_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, CAUSAL=causal, **_dot_flags(q.dtype), **config,
    )
    return out


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
    block_n = config["BLOCK_N"]
    # each split covers a whole number of key tiles
    keys_per_split = max(triton.cdiv(triton.cdiv(max(max_keys, 1), num_splits), block_n) * block_n, block_n)
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
