"""The online softmax every kernel of this package computes, and the device helpers they share.

The maths
---------
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
We work in base 2: scores are multiplied by qk_scale = sm_scale * log2(e) so exp(x) becomes exp2(x'),
which maps to a single hardware instruction; the multiply is fused into the exponent's argument,
exp2(s * qk_scale - m), one FMA per score. The log-sum-exp of a row (used to merge split-K partial results) is
lse = m + log2(l), also in base 2.

Grouped-query attention: query head h reads KV head h // (H / H_kv); K and V are never repeated.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))


# ----------------------------------------------------------------------------------------------
# Shared device helpers (the flash and paged kernels)
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
def _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, GUARD_EMPTY: tl.constexpr, DOT_UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Fold one tile of scores into the running (acc, l, m) state; see the module docstring.

    s: (ROWS, COLS) raw scores <q, k>, -inf where masked.  v: (COLS, D).  qk_scale = sm_scale * log2(e) > 0.
    The scale is applied inside the exponent, s * qk_scale - m, one fused multiply-add per score, and
    to the row max only (a positive factor commutes with max), instead of a multiply per score first.
    GUARD_EMPTY: the tile may contain rows whose every score is -inf and that have seen no key yet
    (m stays -inf); subtract 0 instead of -inf for them so exp2 gives 0 rather than NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # (ROWS,) running max in base-2 units
    if GUARD_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)  # (ROWS,) exp(m_old - m_new), 0 on the first tile
    p = tl.exp2(s * qk_scale - m_ref[:, None])  # (ROWS, COLS); masked scores: exp2(-inf) = 0
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


# Integers that follow the batch size or the split count are not specialised (no compiled variant per
# divisibility by 16): stride_mlh is the split count, stride_mlb = H * split count.
@triton.jit(do_not_specialize=["stride_mlb", "stride_mlh", "max_keys", "keys_per_split", "num_splits"])
def _combine_splits_kernel(
    Mid_O, Mid_LSE, Ctx, O,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    max_keys, keys_per_split, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Merge split-K partial results of one (sequence, query head).

    Split s covers a disjoint key range and produced o_s = acc_s / l_s and lse_s = m_s + log2(l_s).
    The full softmax over the union is o = sum_s w_s o_s / sum_s w_s with w_s = exp2(lse_s - max lse):
    w_s is l_s * exp(m_s) up to the common factor exp2(max lse).

    num_splits is a runtime value (it follows the batch size); only its upper bound SPLITS_P2 is
    compiled in, so batches of any size share one compiled combine kernel.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.minimum(tl.load(Ctx + b), max_keys)  # clamped exactly as in the split kernels
    n_valid = tl.cdiv(ctx, keys_per_split)  # splits past the context wrote nothing
    offs_s = tl.arange(0, SPLITS_P2)  # (S,)
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    s_mask = (offs_s < n_valid) & (offs_s < num_splits)
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


# The kernels were built by the interpreter iff TRITON_INTERPRET was set when triton.jit ran (this
# module's import); setting it later does not turn them into interpreted kernels.
_INTERPRETED = not isinstance(_dot, triton.runtime.JITFunction)
