"""paged_decode_attention against the fp32 reference and against the contiguous decode kernel.

Runs under the Triton interpreter on CPU (switched on before triton is imported, hence the
environment line above the imports). Tolerances as in test_flash_attention.py: fp32 1e-4, fp16 5e-3,
bf16 2e-2 (atol and rtol), reference in fp32 from the same rounded inputs.
"""

import os

import torch

if not torch.cuda.is_available():   # on a GPU the kernels compile; without one Triton's interpreter runs them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ablate_kernels import (  # noqa: E402
    flash_attention_decode,
    launch,  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    triton_available,
)
from ablate_kernels import paged_attention as pa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

needs_triton = pytest.mark.skipif(
    not triton_available(DEVICE),
    reason="no GPU, and the kernels were imported without TRITON_INTERPRET=1 (set it before importing triton)",
)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def make_paged(context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0, spare_blocks=3,
               device=DEVICE):
    """A paged cache holding contiguous per-sequence K/V under a shuffled block table.

    Returns q (B, H, D), the contiguous k, v (B, S_max, H_kv, D) with S_max = blocks_per_seq * block_size,
    the caches (num_blocks, block_size, H_kv, D), block_tables (B, blocks_per_seq) and context_lens (B,).
    Unused cache blocks and the slots past each context are filled with garbage that must not be read.
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
    for b, ctx in enumerate(context_lens):
        for pos in range(ctx):  # only the first ctx tokens are written; the rest stays garbage
            k_cache[table[b, pos // block_size], pos % block_size] = k[b, pos]
            v_cache[table[b, pos // block_size], pos % block_size] = v[b, pos]
    ctx = torch.tensor(context_lens, dtype=torch.int32)  # (B,)
    return tuple(t.to(device) for t in (q, k, v, k_cache, v_cache, table.to(torch.int32), ctx))


@needs_triton
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, head_dim, block_size",
    [
        (torch.float32, 4, 2, 16, 16),  # GQA
        (torch.float32, 4, 1, 32, 16),  # MQA
        (torch.float32, 4, 4, 32, 8),  # MHA, pages smaller than a key tile
        (torch.float32, 4, 2, 16, 32),  # pages larger than a key tile
        (torch.float16, 4, 2, 32, 16),
        (torch.bfloat16, 4, 1, 16, 16),
    ],
)
def test_paged_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    q, _, _, k_cache, v_cache, table, ctx = make_paged([1, 7, 33, 64], block_size, num_heads, num_kv_heads,
                                                       head_dim, dtype)
    out = paged_decode_attention(q, k_cache, v_cache, table, ctx)
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, ctx)
    assert out.shape == (4, num_heads, head_dim)
    assert_matches(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_contiguous_decode(dtype):
    """Same tokens, once through a shuffled block table and once laid out contiguously."""
    q, k, v, k_cache, v_cache, table, ctx = make_paged([5, 16, 40, 70], 16, 4, 2, 16, dtype)
    paged = paged_decode_attention(q, k_cache, v_cache, table, ctx)
    contiguous = flash_attention_decode(q, k, v, ctx)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: at most an output rounding step apart
    torch.testing.assert_close(paged.float(), contiguous.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_split_k_paths(num_splits):
    """Single pass, split-K, and more splits than a short context fills; context 0 outputs zeros."""
    q, _, _, k_cache, v_cache, table, ctx = make_paged([0, 9, 50, 100], 16, 4, 2, 16, torch.float32)
    out = pa._launch_paged(q, k_cache, v_cache, table, ctx, 2, 0.3, num_splits, launch._decode_config(16, torch.float32))
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, ctx, sm_scale=0.3)
    assert_matches(out, ref, torch.float32)
    assert (out[0] == 0).all()


# ---------------------------------------------------------------------------------------------- input checks
# Inputs are checked before the device is, so these run on CPU tensors whatever the machine.


def _paged_args(**overrides):
    q, _, _, k_cache, v_cache, table, ctx = make_paged([3, 20], 16, 4, 2, 16, torch.float32, device="cpu")
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table, "context_lens": ctx}
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("q", {"q": torch.randn(2, 4)}),
        ("q", {"q": torch.randn(2, 4, 48)}),  # head_dim not a power of two
        ("k_cache", {"k_cache": torch.randn(7, 16, 16)}),  # 3-D
        ("k_cache", {"k_cache": torch.randn(7, 16, 3, 16)}),  # 3 KV heads for 4 query heads
        ("k_cache", {"k_cache": torch.randn(7, 16, 2, 16, dtype=torch.bfloat16)}),
        ("k_cache", {"k_cache": torch.randn(7, 16, 16, 2).transpose(2, 3)}),  # head_dim stride != 1
        ("v_cache", {"v_cache": torch.randn(7, 8, 2, 16)}),  # shape differs from k_cache
        ("block_tables", {"block_tables": torch.zeros(2, 2, dtype=torch.int64)}),
        ("block_tables", {"block_tables": torch.zeros(3, 2, dtype=torch.int32)}),  # batch differs
        ("block_tables", {"block_tables": torch.zeros(4, dtype=torch.int32)}),  # 1-D
        ("context_lens", {"context_lens": torch.tensor([3.0, 20.0])}),
        ("context_lens", {"context_lens": torch.tensor([3], dtype=torch.int32)}),
    ],
)
def test_paged_rejects_bad_inputs(name, overrides):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        paged_decode_attention(**_paged_args(**overrides))


def test_paged_runtime_error_when_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="reference.paged_decode_attention_ref"):
        paged_decode_attention(**_paged_args())
