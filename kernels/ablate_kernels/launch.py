"""Host side of the Triton kernels: where they can run, input checks, decode launch configuration, and
the split-K decode's partial buffers and combine launch (shared by decode_attention.py and paged_attention.py).

Everything decided here reads tensor shapes, dtypes, devices and strides only, never tensor values:
no .item(), .tolist(), .cpu(), bool(tensor) or nonzero(), so the decode launchers never synchronise
with the device and can be captured into a CUDA graph (see decode_attention.py). Prefill tile configs
and their selection by timing are in tuning.py.
"""
from __future__ import annotations

import functools
import math

import torch
import triton

from .online_softmax import _INTERPRETED, _combine_splits_kernel

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Upper bound on the split-K count; a power of two, compiled into the combine kernel as SPLITS_P2.
MAX_SPLITS = 64


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


def backend_label(device) -> str:
    """What runs these kernels on `device`, to label results with.

    "triton": compiled Triton kernels (CUDA); "triton-interpreted": Triton's interpreter
    (TRITON_INTERPRET=1, numpy on the CPU: correct but orders of magnitude slower, never a timing);
    "unavailable": the kernels cannot run there.
    """
    if not triton_available(device):
        return "unavailable"
    return "triton-interpreted" if _INTERPRETED else "triton"


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
    """How many key splits (flash-decoding) to use: a power of two in [1, MAX_SPLITS].

    Decode is memory bound: with few (sequence, KV head) programs the GPU's SMs sit idle, so the keys
    are split until there are >= 4 programs per SM (wanted, rounded up to a power of two), while
    keeping about >= 4 key tiles per split so that the extra combine pass stays cheap (by_length,
    rounded down). Powers of two keep the set of launch shapes small as the batch size changes.
    Uses only host-side sizes (no device sync on context_lens), so it is safe under CUDA graph capture.
    """
    if device.type == "cuda":
        sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sm_count = 4  # interpreter: a pretend GPU, so CPU tests also take the split path
    wanted = triton.next_power_of_2(triton.cdiv(4 * sm_count, max(num_programs, 1)))
    by_length = max(triton.cdiv(max_keys, 4 * block_n), 1)
    by_length = 1 << (by_length.bit_length() - 1)  # largest power of two <= by_length
    return int(min(wanted, by_length, MAX_SPLITS))


def _keys_per_split(max_keys: int, num_splits: int, block_n: int) -> int:
    """Keys per split: a whole number of key tiles, num_splits * keys_per_split >= max_keys."""
    return max(triton.cdiv(triton.cdiv(max(max_keys, 1), num_splits), block_n) * block_n, block_n)


def _launch_decode_combine(mid_o, mid_lse, context_lens, out, max_keys, keys_per_split, num_splits, head_dim):
    batch, num_heads = out.shape[0], out.shape[1]
    assert 1 <= num_splits <= MAX_SPLITS, num_splits  # host ints only: no device sync
    _combine_splits_kernel[(batch, num_heads)](
        mid_o, mid_lse, context_lens, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        max_keys, keys_per_split, num_splits,
        SPLITS_P2=MAX_SPLITS, HEAD_DIM=head_dim,  # one compiled variant whatever the split count
        num_warps=4 if head_dim <= 128 else 8,  # (MAX_SPLITS, D) fp32 partials live in registers
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


