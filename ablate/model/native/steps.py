"""The kernels of steps of a few tokens (steps.c): a matrix-vector product for one-row products
(one of the paths ablate/model/linear.py times), and RMSNorm, RoPE and SwiGLU's activation in one call
each.

Why: at one row a product reads each weight once, so a decode step at batch 1 runs at the speed its
weights stream from memory; matvec reads W packed so that each thread's band is one sequential stream
(what it reached against oneDNN and numpy's BLAS: docs/cpu-products.md). It is one more path that the
product-path timing weighs against the others, not a replacement. And torch's RMSNorm on a CPU is six
operations; for a few rows their dispatch is the whole cost.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ablate.model.native.build import available, library

# RMSNorm, RoPE and SwiGLU's activation take the native kernels up to this many tokens (a decode
# batch, a verify pass): there torch's cost is its operations' dispatch (six for RMSNorm, six for RoPE,
# three for the activation), each against caches the weights just evicted; past it, torch's threads
# are worth their start-up
SMALL_ROWS = 16


def takes(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels (rms_norm, rope, silu_mul) take x, tokens first: fp32 on the
    CPU, at most SMALL_ROWS tokens, outside torch.compile (which cannot trace a ctypes call), built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] <= SMALL_ROWS
            and not torch.compiler.is_compiling() and available())


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """W (d_out, d_in) in matvec's layout (steps.c): (ceil(d_out / 8), ceil(d_in / 16), 8, 16), each
    block of 8 rows stored 16 columns at a time, zeros past d_out and d_in."""
    d_out, d_in = w.shape
    padded = F.pad(w.detach(), (0, -d_in % 16, 0, -d_out % 8))                 # (d_out', d_in')
    return padded.view(padded.shape[0] // 8, 8, padded.shape[1] // 16, 16).transpose(1, 2).contiguous()


def matvec(packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, d_out: int, threads: int) -> torch.Tensor:
    """x W^T + b for one row x (..., d_in), W fp32 on the CPU packed by pack_rows -> (..., d_out).

    The C kernel trusts its pointers, so what they point at is checked here first: a pack of another
    shape than (d_out, d_in), or a bias shorter than d_out, would have it read past their ends."""
    want = (-(-d_out // 8), -(-x.shape[-1] // 16), 8, 16)
    if (tuple(packed.shape) != want or not packed.is_contiguous() or packed.dtype != torch.float32
            or x.dtype != torch.float32 or x.numel() != x.shape[-1] or (bias is not None and bias.numel() != d_out)):
        raise ValueError(f"native matvec: W packed as {tuple(packed.shape)} {packed.dtype}, one {x.dtype} row of "
                         f"{tuple(x.shape)} and a bias of {None if bias is None else bias.numel()} cannot make "
                         f"{d_out} outputs: expected pack_rows of a ({d_out}, {x.shape[-1]}) fp32 W, shape {want}")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], d_out, dtype=x.dtype, device=x.device)
    library().matvec(packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     d_out, x.shape[-1], threads)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension: fp32 CPU tensors, weight contiguous."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, 1, D), rotate-half layout (ablate/model/rope.py) -> (T, H, D)."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), *x.shape)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (T, 2F) = [gate | up] -> (T, F)."""
    gate_up = gate_up.contiguous()
    rows, f = gate_up.shape[0], gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], f, dtype=gate_up.dtype, device=gate_up.device)
    library().silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, f)
    return y
