"""paged_decode_attention against the fp32 reference and against the contiguous decode kernel.

Runs under the Triton interpreter on CPU (switched on before triton is imported:
kernels/tests/conftest.py). Accuracy: relative error against the fp32 reference from the same
rounded inputs (ablate_kernels.testing.REL_TOL: fp32 1e-4, fp16 3e-3, bf16 1.5e-2).
"""

import pytest
import torch

from ablate_kernels import (
    flash_attention_decode,
    launch,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from ablate_kernels import paged_attention as pa
from ablate_kernels.testing import (DEVICE, SPLIT_BATCHES, SPLIT_KV_HEADS, SPLIT_LEN, assert_close_relative, make_paged,
                                    needs_triton)


@needs_triton
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, head_dim, block_size",
    [  # head dims 64 / 128 / 256 x GQA groups 1 / 3 / 4 / 9 x dtypes x page sizes, spread rather than crossed;
       # the larger ones: slow (CI runs them)
        (torch.float32, 8, 8, 64, 16),  # MHA, group 1
        (torch.bfloat16, 9, 1, 64, 8),  # MQA, group 9; pages smaller than a key tile
        (torch.float16, 9, 3, 128, 32),  # group 3; pages larger than a key tile
        pytest.param(torch.bfloat16, 12, 3, 128, 16, marks=pytest.mark.slow),  # group 4
        pytest.param(torch.float16, 12, 3, 256, 16, marks=pytest.mark.slow),
        pytest.param(torch.float32, 9, 3, 256, 8, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 8, 8, 256, 32, marks=pytest.mark.slow),
        (torch.float32, 4, 2, 16, 16),  # the smallest head dim
    ],
)
def test_paged_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    q, _, _, k_cache, v_cache, table, ctx = make_paged([1, 7, 33, 64], block_size, num_heads, num_kv_heads,
                                                       head_dim, dtype, DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, table, ctx)
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, ctx)
    assert out.shape == (4, num_heads, head_dim)
    assert_close_relative(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_contiguous_decode(dtype):
    """Same tokens, once through a shuffled block table and once laid out contiguously."""
    q, k, v, k_cache, v_cache, table, ctx = make_paged([5, 16, 40, 70], 16, 4, 2, 16, dtype, DEVICE)
    paged = paged_decode_attention(q, k_cache, v_cache, table, ctx)
    contiguous = flash_attention_decode(q, k, v, ctx)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: at most an output rounding step apart
    torch.testing.assert_close(paged.float(), contiguous.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_split_k_paths(num_splits):
    """Single pass, split-K, and more splits than a short context fills; context 0 outputs zeros."""
    q, _, _, k_cache, v_cache, table, ctx = make_paged([0, 9, 50, 100], 16, 4, 2, 16, torch.float32, DEVICE)
    out = pa._launch_paged(q, k_cache, v_cache, table, ctx, 2, 0.3, num_splits, launch._decode_config(16, torch.float32))
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, ctx, sm_scale=0.3)
    assert_close_relative(out, ref, torch.float32)
    assert (out[0] == 0).all()


@needs_triton
@pytest.mark.slow      # several batch sizes in the interpreter (~3 s); the split counts: kernels/tests/test_runtime.py
def test_paged_split_count_follows_the_batch_size():
    """One block-table width, several batch sizes and so several runtime split counts: all correct."""
    head_dim, dtype, block_size = 64, torch.bfloat16, 16
    block_n = launch._decode_config(head_dim, dtype)["BLOCK_N"]
    splits = set()
    for batch in SPLIT_BATCHES:
        contexts = [SPLIT_LEN if i % 3 == 0 else (i * 37) % SPLIT_LEN for i in range(batch)]  # ragged, some full
        q, _, _, k_cache, v_cache, table, ctx = make_paged(contexts, block_size, SPLIT_KV_HEADS, SPLIT_KV_HEADS,
                                                           head_dim, dtype, DEVICE, seed=batch)
        splits.add(launch._num_splits(batch * SPLIT_KV_HEADS, table.shape[1] * block_size, block_n, q.device))
        out = paged_decode_attention(q, k_cache, v_cache, table, ctx)
        ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, ctx)
        assert_close_relative(out, ref, dtype)
    assert len(splits) >= 2 and max(splits) > 1, splits


# ---------------------------------------------------------------------------------------------- input checks
# Inputs are checked before the device is, so these run on CPU tensors whatever the machine.


def _paged_args(**overrides):
    q, _, _, k_cache, v_cache, table, ctx = make_paged([3, 20], 16, 4, 2, 16, torch.float32, "cpu")
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
