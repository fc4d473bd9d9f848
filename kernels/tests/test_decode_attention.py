"""flash_attention_decode (padded KV cache, split-K) against the fp32 PyTorch reference.

On a machine without a GPU the kernels run under the Triton interpreter, switched on before triton is
first imported (kernels/tests/conftest.py). Shapes are small because the interpreter
executes every program in numpy. Accuracy: relative error against the fp32 reference
(ablate_kernels.testing.REL_TOL: fp32 1e-4, fp16 3e-3, bf16 1.5e-2).
"""

import pytest
import torch

from ablate_kernels import decode_attention as da
from ablate_kernels import (
    flash_attention_decode,
    flash_attention_decode_ref,
    flash_attention_varlen,
    launch,
)
from ablate_kernels.testing import (DEVICE, SPLIT_BATCHES, SPLIT_KV_HEADS, SPLIT_LEN, assert_close_relative, cumulative,
                                    make_decode, needs_triton)


def split_test_contexts(batch: int) -> list[int]:
    """Ragged context lengths up to SPLIT_LEN, every third one full."""
    return [SPLIT_LEN if i % 3 == 0 else (i * 37) % SPLIT_LEN for i in range(batch)]



@needs_triton
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, head_dim",
    [  # head dims 64 / 128 / 256 x GQA groups 1 / 3 / 4 / 9 x dtypes, spread rather than crossed; the larger
       # ones: slow (CI runs them)
        (torch.float32, 8, 8, 64),  # MHA, group 1
        (torch.bfloat16, 9, 1, 64),  # MQA, group 9 (BLOCK_H 16, 7 padding rows)
        (torch.float16, 9, 3, 128),  # group 3
        pytest.param(torch.bfloat16, 12, 3, 128, marks=pytest.mark.slow),  # group 4
        pytest.param(torch.float16, 12, 3, 256, marks=pytest.mark.slow),
        pytest.param(torch.float32, 9, 3, 256, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 8, 8, 256, marks=pytest.mark.slow),
        (torch.float32, 4, 2, 16),  # the smallest head dim
    ],
)
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    q, k, v, ctx = make_decode([1, 7, 33, 70], 70, num_heads, num_kv_heads, head_dim, dtype, DEVICE)
    assert not k.is_contiguous()
    out = flash_attention_decode(q, k, v, ctx)
    ref = flash_attention_decode_ref(q.float(), k.float(), v.float(), ctx)
    assert out.shape == (4, num_heads, head_dim)
    assert_close_relative(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_k_paths(num_splits):
    """Single pass, split-K (also a count that is not a power of two), and more splits than a short
    context fills; context 0 outputs zeros."""
    q, k, v, ctx = make_decode([0, 5, 64, 100], 100, 4, 2, 16, torch.float32, DEVICE)
    out = da._launch_decode(q, k, v, ctx, 2, 0.25, num_splits, launch._decode_config(16, torch.float32))
    ref = flash_attention_decode_ref(q.float(), k.float(), v.float(), ctx, sm_scale=0.25)
    assert_close_relative(out, ref, torch.float32)
    assert (out[0] == 0).all()


@needs_triton
@pytest.mark.slow      # several batch sizes in the interpreter (~3 s); the split counts: kernels/tests/test_runtime.py
def test_decode_split_count_follows_the_batch_size():
    """Continuous batching: one padded length, several batch sizes, hence several runtime split counts
    (the combine kernel takes the count as an argument); every one matches the reference."""
    head_dim, dtype = 64, torch.float16
    block_n = launch._decode_config(head_dim, dtype)["BLOCK_N"]
    splits = set()
    for batch in SPLIT_BATCHES:
        splits.add(launch._num_splits(batch * SPLIT_KV_HEADS, SPLIT_LEN, block_n, torch.device(DEVICE)))
        q, k, v, ctx = make_decode(split_test_contexts(batch), SPLIT_LEN, SPLIT_KV_HEADS, SPLIT_KV_HEADS, head_dim,
                                   dtype, DEVICE, seed=batch)
        out = flash_attention_decode(q, k, v, ctx)
        ref = flash_attention_decode_ref(q.float(), k.float(), v.float(), ctx)
        assert_close_relative(out, ref, dtype)
    assert len(splits) >= 2 and max(splits) > 1, splits  # the batch sizes did take different split paths


@needs_triton
def test_decode_equals_varlen_last_query():
    """A decode step is the last row of causal attention over the same keys."""
    lens = [3, 20]
    q, k, v, ctx = make_decode(lens, 20, 4, 2, 16, torch.float32, DEVICE)
    packed_k = torch.cat([k[b, :n] for b, n in enumerate(lens)])  # (T_k, H_kv, D)
    packed_v = torch.cat([v[b, :n] for b, n in enumerate(lens)])  # (T_k, H_kv, D)
    ones = cumulative([1, 1], DEVICE)
    out_varlen = flash_attention_varlen(q, packed_k, packed_v, ones, cumulative(lens, DEVICE), 1, 20, causal=True)
    out_decode = flash_attention_decode(q, k, v, ctx)
    torch.testing.assert_close(out_decode, out_varlen, atol=1e-5, rtol=1e-5)
