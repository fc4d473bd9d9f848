"""What the kernels do around a launch: split counts, compiled variants, labels, and CUDA-graph safety
of the decode launchers (their host side may read tensor shapes, never tensor values).

kernels/tests/conftest.py switches Triton's interpreter on where there is no GPU.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import triton
from torch.overrides import TorchFunctionMode

import ablate_kernels
from ablate_kernels import decode_attention as da
from ablate_kernels import flash_attention as fa
from ablate_kernels import launch, tuning, variants
from ablate_kernels import paged_attention as pa
from ablate_kernels.testing import DEVICE, assert_close_relative, make_decode, make_paged, make_varlen

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or launch._INTERPRETED,
                                reason="needs compiled Triton kernels on a CUDA GPU")


def test_num_splits_are_bounded_powers_of_two():
    devices = [torch.device("cpu")] + ([torch.device(DEVICE)] if DEVICE == "cuda" else [])
    seen = set()
    for device in devices:
        for num_programs in (0, 1, 2, 3, 5, 8, 31, 64, 100, 256, 1000, 4096):
            for max_keys in (0, 1, 15, 16, 100, 1000, 4096, 32768, 1 << 20):
                for block_n in (16, 32, 64, 128):
                    splits = launch._num_splits(num_programs, max_keys, block_n, device)
                    assert isinstance(splits, int) and 1 <= splits <= launch.MAX_SPLITS
                    assert splits & (splits - 1) == 0, splits  # a power of two
                    seen.add(splits)
    assert launch.MAX_SPLITS & (launch.MAX_SPLITS - 1) == 0
    assert len(seen) <= int(math.log2(launch.MAX_SPLITS)) + 1


def test_compiled_variants_is_a_count():
    count = ablate_kernels.compiled_variants()
    assert isinstance(count, int) and count >= 0
    if launch._INTERPRETED:
        assert count == 0  # the interpreter compiles nothing


def test_cache_entries_reads_both_triton_layouts():
    """Triton >= 3.2: device_caches {device: (kernel_cache, ...)}; older: cache {device: {key: kernel}}."""
    current = SimpleNamespace(device_caches=defaultdict(lambda: ({}, {}, "target", "backend", "binder")))
    current.device_caches[0][0].update(a=1, b=2)
    current.device_caches[1][0]["c"] = 3
    assert variants._cache_entries(current) == 3
    assert variants._cache_entries(SimpleNamespace(cache={0: {"a": 1}, 1: {"b": 2, "c": 3}})) == 3
    assert variants._cache_entries(SimpleNamespace()) == 0


def test_backend_label(monkeypatch):
    assert ablate_kernels.backend_label("meta") == "unavailable"
    expected_cpu = "triton-interpreted" if launch._INTERPRETED else "unavailable"
    assert ablate_kernels.backend_label("cpu") == expected_cpu
    assert ablate_kernels.backend_label(torch.zeros(1)) == expected_cpu
    if torch.cuda.is_available():
        assert ablate_kernels.backend_label("cuda") == ("triton-interpreted" if launch._INTERPRETED else "triton")
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    assert ablate_kernels.backend_label("cpu") == "unavailable"


def test_interpreter_uses_its_single_prefill_config():
    if launch._INTERPRETED:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert tuning.prefill_candidates(128, dtype) == [tuning._INTERPRETER_CONFIG]
    assert tuning.seqlen_bucket(1) == tuning.seqlen_bucket(100) == tuning._MIN_BUCKET
    assert tuning.seqlen_bucket(4097) == tuning.seqlen_bucket(8192) == 8192


class _RecordingKernel:
    """Stands in for a Triton kernel: records the grid and the non-tensor arguments of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            scalars = [a for a in args if not isinstance(a, torch.Tensor)]
            self.launches.append((grid, scalars, kwargs))
        return launch_


class _NoDeviceSync(TorchFunctionMode):
    """Fails on every tensor operation that copies a value to the host (a device sync on a GPU)."""

    FORBIDDEN = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.FORBIDDEN:
            raise AssertionError(f"{func.__name__} on the decode launch path: a host-device sync")
        return func(*args, **(kwargs or {}))


def test_decode_launch_decisions_depend_on_shapes_only(monkeypatch):
    """CUDA-graph safety, checked on any machine: with the kernels replaced by recorders, the decode
    launchers run without reading any tensor value, and two context_lens with the same shape but
    different values give identical launches (grids, split counts, scalars)."""
    monkeypatch.setattr(launch, "_INTERPRETED", launch._INTERPRETED or DEVICE == "cpu")  # pass the device check
    recorders = {}
    for module, name in ((da, "_flash_decode_kernel"), (pa, "_paged_decode_kernel"), (launch, "_combine_splits_kernel")):
        recorders[name] = _RecordingKernel()
        monkeypatch.setattr(module, name, recorders[name])
    q, k, v, k_cache, v_cache, table, _ = make_paged([512] * 3, 16, 4, 1, 32, torch.float16, DEVICE)
    for lens in ([512, 1, 30], [0, 512, 7]):
        ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)  # (B,)
        with _NoDeviceSync():
            ablate_kernels.flash_attention_decode(q, k, v, ctx)
            ablate_kernels.paged_decode_attention(q, k_cache, v_cache, table, ctx)
    for name, recorder in recorders.items():
        first, second = recorder.launches[0::2], recorder.launches[1::2]
        assert len(first) == len(second) and first == second, name
    assert recorders["_combine_splits_kernel"].launches, "the shape should take the split-K path"


@needs_cuda
def test_decode_launchers_capture_into_a_cuda_graph():
    """Captured once, replayed with new context_lens values: the outputs follow the new values."""
    batch, max_len, num_kv_heads, head_dim, dtype = 2, 512, 2, 64, torch.bfloat16
    q, k, v, ctx = make_decode([max_len] * batch, max_len, 8, num_kv_heads, head_dim, dtype, DEVICE)
    *_, k_cache, v_cache, table, _ = make_paged([max_len] * batch, 16, 8, num_kv_heads, head_dim, dtype, DEVICE)
    assert launch._num_splits(batch * num_kv_heads, max_len, 64, q.device) > 1  # the split path is captured
    with torch.cuda.device(q.device):
        torch.cuda.set_sync_debug_mode("error")  # any host-device sync raises
        try:
            for _ in range(2):  # warm up: compile outside the capture
                ablate_kernels.flash_attention_decode(q, k, v, ctx)
                ablate_kernels.paged_decode_attention(q, k_cache, v_cache, table, ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_dense = ablate_kernels.flash_attention_decode(q, k, v, ctx)
            out_paged = ablate_kernels.paged_decode_attention(q, k_cache, v_cache, table, ctx)
        for lens in ([max_len, 5], [0, 300], [129, max_len - 1]):
            ctx.copy_(torch.tensor(lens, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            assert_close_relative(out_dense, ablate_kernels.flash_attention_decode_ref(
                q.float(), k.float(), v.float(), ctx), dtype)
            assert_close_relative(out_paged, ablate_kernels.paged_decode_attention_ref(
                q.float(), k_cache.float(), v_cache.float(), table, ctx), dtype)


@needs_cuda
def test_compiled_variants_stop_growing_after_warmup():
    """Continuous batching: after one pass over batch sizes 1..8 (one context length) and two prefill
    lengths of one bucket, running the same shapes again compiles nothing."""
    def one_pass():
        for batch in range(1, 9):
            lens = [700 - 83 * i for i in range(batch)]
            q, k, v, ctx = make_decode(lens, 1024, 8, 2, 128, torch.bfloat16, DEVICE, seed=batch)
            ablate_kernels.flash_attention_decode(q, k, v, ctx)
            q, _, _, k_cache, v_cache, table, ctx = make_paged(lens, 16, 8, 2, 128, torch.bfloat16, DEVICE, seed=batch)
            ablate_kernels.paged_decode_attention(q, k_cache, v_cache, table, ctx)
        for q_lens in ([300, 17], [512]):  # one length bucket: tuned by the first, the pick reused by the second
            q, k, v, cu_q, cu_k = make_varlen(q_lens, q_lens, 8, 2, 128, torch.bfloat16, DEVICE)
            out = ablate_kernels.flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(q_lens))
            ref = ablate_kernels.flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k)
            assert_close_relative(out, ref, torch.bfloat16)
        torch.cuda.synchronize()

    one_pass()
    warm = ablate_kernels.compiled_variants()
    assert warm > 0
    assert (128, torch.bfloat16, True, 512) in tuning._picked  # later calls skip the autotuner's dispatch
    one_pass()
    assert ablate_kernels.compiled_variants() == warm


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_prefill_candidate_is_correct(head_dim):
    """Each tile config the autotuner may pick gives the reference result (configs that do not fit this
    GPU's shared memory are skipped, as the autotuner skips them)."""
    q_lens, k_lens = [1, 100, 300], [1, 164, 300]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, 8, 2, head_dim, torch.bfloat16, DEVICE)
    ref = ablate_kernels.flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True)
    ran = 0
    for config in tuning.prefill_candidates(head_dim, torch.bfloat16):
        out = torch.empty_like(q)
        try:
            fa._launch_varlen(q, k, v, cu_q, cu_k, max(q_lens), out, 4, True, 1 / math.sqrt(head_dim), config)
        except triton.runtime.errors.OutOfResources:
            continue
        assert_close_relative(out, ref, torch.bfloat16)
        ran += 1
    assert ran > 0
