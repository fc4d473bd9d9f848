"""Random kernel inputs and the accuracy check shared by the kernel tests (kernels/tests).

Accuracy is the relative error max |out - ref| / max |ref| against the fp32 references of reference.py,
computed from the same rounded inputs. fp32 runs IEEE dots, so only the summation order differs
(1e-4 leaves a wide margin). In fp16 / bf16 (unit roundoff u = 2^-11 / 2^-8) the probabilities are
rounded before P @ V, |sum_j (p~_j - p_j) v_j| / l <= u max|v|, and the output is rounded, <= u |o|:
about 2u of max|v|, and max|v| may exceed max|ref| by a little, hence 3e-3 and 1.5e-2.
Nothing here imports triton at import time: kernels/tests/conftest.py decides whether it runs
interpreted before it is imported.
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Continuous batching: one padded length (or block-table width), several batch sizes, hence several
# split counts: the count follows batch x KV heads against the SM count (4 pretend SMs under the
# interpreter), so a GPU needs bigger batches to change it
if DEVICE == "cpu":
    SPLIT_LEN, SPLIT_KV_HEADS, SPLIT_BATCHES = 256, 2, (1, 3, 5, 8)
else:
    SPLIT_LEN, SPLIT_KV_HEADS, SPLIT_BATCHES = 1024, 8, (1, 32, 64, 128)


def _triton_runs() -> bool:
    from ablate_kernels import triton_available
    return triton_available(DEVICE)


needs_triton = pytest.mark.skipif(
    not _triton_runs(),
    reason="no GPU, and the kernels were imported without TRITON_INTERPRET=1 (set it before importing triton)",
)

REL_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 when both are all zero)."""
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return err / scale if scale > 0 else err


def assert_close_relative(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype, out.dtype
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= REL_TOL[dtype], f"relative error {err:.2e} above {REL_TOL[dtype]:.0e} for {dtype}"


def cumulative(lengths, device) -> torch.Tensor:
    """(B+1,) int32 cumulative starts of sequences with the given lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_varlen(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Packed q (T_q, H, D), k, v (T_k, H_kv, D) and their cu_seqlens (B+1,)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device, dtype)  # (T_q, H, D)
    k = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen).to(device, dtype)  # (T_k, H_kv, D)
    v = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen).to(device, dtype)  # (T_k, H_kv, D)
    return q, k, v, cumulative(q_lens, device), cumulative(k_lens, device)


def make_decode(context_lens, max_len, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """q (B, H, D), k, v (B, S_max, H_kv, D) as non-contiguous views (a slice of the heads), context_lens (B,)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device, dtype)  # (B, H, D)
    kv = torch.randn(2, batch, max_len, num_kv_heads + 1, head_dim, generator=gen).to(device, dtype)
    k, v = kv[0, :, :, 1:], kv[1, :, :, 1:]  # (B, S_max, H_kv, D) views, not contiguous
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)  # (B,)
    return q, k, v, ctx


def make_paged(context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0, spare_blocks=3):
    """A paged cache holding contiguous per-sequence K/V under a shuffled block table.

    Returns q (B, H, D), the contiguous k, v (B, S_max, H_kv, D) with S_max = blocks_per_seq * block_size,
    the caches (num_blocks, block_size, H_kv, D), block_tables (B, blocks_per_seq) and context_lens (B,).
    Unused cache blocks and the slots past each context hold large garbage that must not be read.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    blocks_per_seq = max(-(-max(context_lens) // block_size), 1)
    max_len = blocks_per_seq * block_size
    num_blocks = batch * blocks_per_seq + spare_blocks
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)  # (B, H, D)
    k = torch.randn(batch, max_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # (B, S_max, H_kv, D)
    v = torch.randn(batch, max_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # (B, S_max, H_kv, D)
    # physical blocks are handed out in a random order: logical block j of sequence b -> table[b, j]
    table = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) * 100
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) * 100
    for b, ctx in enumerate(context_lens):  # only the first ctx tokens are written; the rest stays garbage
        pos = torch.arange(ctx)  # (ctx,)
        k_cache[table[b, pos // block_size], pos % block_size] = k[b, :ctx]
        v_cache[table[b, pos // block_size], pos % block_size] = v[b, :ctx]
    ctx = torch.tensor(context_lens, dtype=torch.int32)  # (B,)
    return tuple(t.to(device) for t in (q, k, v, k_cache, v_cache, table.to(torch.int32), ctx))
