"""flash_attention_varlen against the fp32 PyTorch reference, and the input checks of the public API.

On a machine without a GPU the kernels run under the Triton interpreter, switched on before triton
is first imported (kernels/tests/conftest.py). Shapes are small
because the interpreter executes every program in numpy. Accuracy: relative error against the fp32
reference (ablate_kernels.testing.REL_TOL: fp32 1e-4, fp16 3e-3, bf16 1.5e-2).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate_kernels import flash_attention as fa
from ablate_kernels import (
    flash_attention_decode,
    flash_attention_varlen,
    flash_attention_varlen_ref,
    launch,
    triton_available,
)
from ablate_kernels.testing import DEVICE, assert_close_relative, make_decode, make_varlen, needs_triton


def varlen_both(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, causal, sm_scale=None):
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, DEVICE)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, sm_scale=sm_scale)
    ref = flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=causal, sm_scale=sm_scale)
    return out, ref


# ---------------------------------------------------------------------------------------------- varlen

# Ragged batches, not multiples of the interpreter's 32 x 16 tiles; the 2nd and 3rd sequences have a KV prefix
Q_LENS, K_LENS = [1, 7, 33, 40], [1, 12, 50, 40]


@needs_triton
@pytest.mark.parametrize(
    "dtype, causal, num_heads, num_kv_heads, head_dim",
    [  # head dims 64 / 128 / 256 x GQA groups 1 / 3 / 4 / 9 x dtypes, spread rather than crossed; the larger
       # ones take seconds each in the interpreter: slow (CI runs them)
        (torch.float32, True, 8, 8, 64),  # MHA, group 1
        (torch.bfloat16, True, 9, 1, 64),  # MQA, group 9 (not a power of two)
        pytest.param(torch.float16, False, 9, 3, 128, marks=pytest.mark.slow),  # group 3
        pytest.param(torch.bfloat16, True, 12, 3, 128, marks=pytest.mark.slow),  # group 4
        pytest.param(torch.float16, True, 12, 3, 256, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, False, 8, 8, 256, marks=pytest.mark.slow),
        pytest.param(torch.float32, False, 9, 3, 256, marks=pytest.mark.slow),
        (torch.float32, True, 4, 2, 16),  # the smallest head dim
        (torch.float16, True, 4, 1, 32),
    ],
)
def test_varlen_prefill_matches_reference(dtype, causal, num_heads, num_kv_heads, head_dim):
    out, ref = varlen_both(Q_LENS, K_LENS, num_heads, num_kv_heads, head_dim, dtype, causal)
    assert out.shape == (sum(Q_LENS), num_heads, head_dim)
    assert_close_relative(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_with_kv_prefix_matches_reference(causal):
    """Chunked prefill / multi-token verification: fewer queries than keys, bottom-right causal."""
    q_lens, k_lens = [1, 4, 17, 33], [9, 4, 50, 40]
    out, ref = varlen_both(q_lens, k_lens, 4, 2, 16, torch.float32, causal)
    assert_close_relative(out, ref, torch.float32)


@needs_triton
def test_varlen_causal_last_query_sees_every_key():
    """Bottom-right alignment: the last query of each sequence attends over all of its keys."""
    q_lens, k_lens = [3, 5], [20, 5]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, 2, 2, 16, torch.float32, DEVICE)
    causal = flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 20, causal=True)
    full = flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 20, causal=False)
    last_rows = (cu_q[1:] - 1).long()
    torch.testing.assert_close(causal[last_rows], full[last_rows], atol=1e-5, rtol=1e-5)


@needs_triton
def test_varlen_rows_without_keys_are_zero():
    """Empty key sequences and causal rows with more queries than keys output 0, like the reference."""
    for causal, q_lens, k_lens in [(False, [3, 2, 5], [0, 4, 5]), (True, [6, 2], [3, 2])]:
        out, ref = varlen_both(q_lens, k_lens, 4, 2, 16, torch.float32, causal)
        assert torch.isfinite(out).all()
        assert_close_relative(out, ref, torch.float32)
    assert (out[:3] == 0).all()  # rows 0..2 of the 6-query / 3-key sequence see no key


@needs_triton
def test_varlen_empty_query_sequence_and_custom_scale():
    out, ref = varlen_both([0, 5, 17], [4, 5, 17], 4, 2, 16, torch.float32, True, sm_scale=0.3)
    assert_close_relative(out, ref, torch.float32)


@needs_triton
@pytest.mark.parametrize(
    "block_m, block_n, q_lens, k_lens",
    [
        (128, 64, [1, 100, 150], [1, 100, 200]),  # the GPU config for head_dim <= 128
        pytest.param(64, 32, [1, 100, 150], [1, 100, 200], marks=pytest.mark.slow),  # fp32 / head_dim 256
        (16, 32, [1, 20, 45], [1, 30, 70]),  # BLOCK_N > BLOCK_M
    ],
)
def test_varlen_gpu_tile_sizes(block_m, block_n, q_lens, k_lens):
    """The GPU tile configs, with sequences crossing several query and key tiles and a KV prefix."""
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, 4, 2, 16, torch.float16, DEVICE)
    out = torch.empty_like(q)
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    fa._launch_varlen(q, k, v, cu_q, cu_k, max(q_lens), out, 2, True, 0.25, config)
    ref = flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True, sm_scale=0.25)
    assert_close_relative(out, ref, torch.float16)


@needs_triton
@pytest.mark.slow      # five random batches in the interpreter (~2 s); ragged batches: the cases above
@settings(max_examples=5, deadline=None, derandomize=True, database=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 24)), min_size=1, max_size=3),
    causal=st.booleans(),
    num_kv_heads=st.sampled_from([1, 2, 4]),
)
def test_varlen_random_ragged_batches(lengths, causal, num_kv_heads):
    """Random ragged batches; each sequence has q_len queries and q_len + prefix keys."""
    q_lens = [q_len for q_len, _ in lengths]
    k_lens = [q_len + prefix for q_len, prefix in lengths]
    out, ref = varlen_both(q_lens, k_lens, 4, num_kv_heads, 16, torch.float32, causal)
    assert_close_relative(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------- input checks
# Inputs are checked before the device is, so these run on CPU tensors whatever the machine.


def _varlen_args(**overrides):
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [3, 5], 4, 2, 16, torch.float32, "cpu")
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
            "max_seqlen_k": 5}
    args.update(overrides)
    return args


def _decode_args(**overrides):
    q, k, v, ctx = make_decode([3, 5], 8, 4, 2, 16, torch.float32, "cpu")
    args = {"q": q, "k": k, "v": v, "context_lens": ctx}
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("q", {"q": torch.randn(8, 64)}),  # 2-D
        ("q", {"q": torch.randn(8, 4, 24)}),  # head_dim not a power of two
        ("q", {"q": torch.randn(8, 4, 512)}),  # head_dim too large
        ("q", {"q": torch.randn(8, 4, 16, dtype=torch.float64)}),
        ("q", {"q": torch.randn(8, 16, 4).transpose(1, 2)}),  # head_dim stride != 1
        ("k", {"k": torch.randn(8, 3, 16)}),  # 4 query heads, 3 KV heads
        ("k", {"k": torch.randn(8, 2, 16, dtype=torch.float16)}),  # dtype differs from q
        ("k", {"k": torch.randn(8, 2, 32)}),  # head_dim differs from q
        ("v", {"v": torch.randn(7, 2, 16)}),
        ("cu_seqlens_q", {"cu_seqlens_q": torch.tensor([0, 3, 8])}),  # int64
        ("cu_seqlens_q", {"cu_seqlens_q": torch.tensor([[0, 3, 8]], dtype=torch.int32)}),
        ("cu_seqlens_k", {"cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}),  # B differs
        ("cu_seqlens_k", {"cu_seqlens_k": torch.zeros(3, dtype=torch.int32, device="meta")}),  # device
        ("max_seqlen_q", {"max_seqlen_q": -1}),
        ("max_seqlen_k", {"max_seqlen_k": 5.0}),
        ("sm_scale", {"sm_scale": -1.0}),
    ],
)
def test_varlen_rejects_bad_inputs(name, overrides):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        flash_attention_varlen(**_varlen_args(**overrides))


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("q", {"q": torch.randn(2, 4, 16, 1)}),
        ("q", {"q": torch.randn(2, 4, 8)}),  # head_dim below 16
        ("k", {"k": torch.randn(2, 8, 16)}),  # 3-D
        ("k", {"k": torch.randn(3, 8, 2, 16)}),  # batch differs from q
        ("k", {"k": torch.randn(2, 8, 3, 16)}),  # 3 KV heads for 4 query heads
        ("v", {"v": torch.randn(2, 9, 2, 16)}),
        ("context_lens", {"context_lens": torch.tensor([3, 5])}),  # int64
        ("context_lens", {"context_lens": torch.tensor([3, 5, 1], dtype=torch.int32)}),
    ],
)
def test_decode_rejects_bad_inputs(name, overrides):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        flash_attention_decode(**_decode_args(**overrides))


def test_runtime_error_when_triton_cannot_run(monkeypatch):
    """CPU tensors without the interpreter: a RuntimeError pointing at the reference / sdpa path."""
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    assert not triton_available("cpu")
    with pytest.raises(RuntimeError, match="reference.flash_attention_varlen_ref"):
        flash_attention_varlen(**_varlen_args())
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
        flash_attention_decode(**_decode_args())


def test_triton_available():
    assert triton_available(torch.device("cpu")) == launch._INTERPRETED
    assert triton_available(torch.zeros(1)) == launch._INTERPRETED
    assert not triton_available("meta")
    assert triton_available("cuda") == torch.cuda.is_available()
