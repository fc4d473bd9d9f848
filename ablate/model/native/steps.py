"""The CPU kernels of steps.c: a matrix-vector product for products of a few rows (one of the paths
ablate/model/linear.py times), and RMSNorm, RoPE and SwiGLU's activation in one call each.

Why: at a few rows a product reads each weight once, so a decode step runs at the speed its weights
stream from memory; matvec reads W where the model holds it, row-major, and each block of W once for
all the rows (what it reached against MKL and numpy's BLAS: docs/cpu-products.md). It is one more path
that the product-path timing weighs against the others, not a replacement. And torch's RMSNorm on a CPU is six
operations, each a pass over x (RoPE six, SwiGLU's activation three): one pass does the same work.
"""
from __future__ import annotations

import torch

from ablate.model.native.build import available, library

# the most rows the matrix-vector kernel takes: past it a product reuses each weight across its rows, and
# MKL's blocked GEMM is the faster (linear.py times the paths up to here)
SMALL_ROWS = 16
BF16_ROWS = 256     # the most rows bf16 RMSNorm takes the kernel for (takes())


def takes(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the elementwise kernels (rms_norm, rope, silu_mul) take x: of `dtypes` (fp32; rms_norm:
    NORM_DTYPES) on the CPU, with no gradient to keep, outside torch.compile (which cannot trace a
    ctypes call), built. Any number of rows: each kernel is one pass over x where torch makes three to
    six operations, split between torch's threads once a call is large (steps.c: PARALLEL_FLOATS);
    from 1 to 8192 rows of SmolLM2's widths fp32 ran 1.1-8x torch's (benchmarks/elementwise_kernels.py). bf16
    (rms_norm's scalar loop) up to BF16_ROWS, where it stops beating torch's."""
    return (x.dtype in dtypes and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
            and (x.dtype != torch.bfloat16 or x.shape[0] <= BF16_ROWS)
            and not torch.compiler.is_compiling() and available())


MATVEC_DTYPES = (torch.float32, torch.bfloat16)     # W, x, bias and y all of one of these


def matvec(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    """x W^T + b for a few rows x (..., d_in), at most SMALL_ROWS of them, on W (d_out, d_in) as the
    model holds it, row-major, fp32 or bf16 (sums in fp32) -> (..., d_out) in W's dtype.

    The C kernel trusts its pointers, so what they point at is checked here first: a W that is not
    row-major, an input of another width or dtype, or a bias shorter than d_out would have it read
    past their ends."""
    d_out, d_in = w.shape
    rows = x.numel() // max(x.shape[-1], 1)
    if (not w.is_contiguous() or w.dtype not in MATVEC_DTYPES or x.dtype != w.dtype or x.shape[-1] != d_in
            or not 1 <= rows <= SMALL_ROWS or (bias is not None and (bias.numel() != d_out or bias.dtype != w.dtype
                                                                       or not bias.is_contiguous()))):
        raise ValueError(f"native matvec: W {tuple(w.shape)} {w.dtype} (row-major: {w.is_contiguous()}), input "
                         f"{tuple(x.shape)} {x.dtype} and a bias of {None if bias is None else bias.numel()}: expected "
                         f"a row-major fp32 or bf16 W, 1 to {SMALL_ROWS} rows of width {d_in} and a bias of {d_out}, "
                         "all of W's dtype")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], d_out, dtype=x.dtype, device=x.device)
    b = None if bias is None else bias.data_ptr()
    if w.dtype == torch.float32:
        library().matvec(w.data_ptr(), x.data_ptr(), b, y.data_ptr(), rows, d_out, d_in, threads)
    else:
        scratch = torch.empty(rows * d_in + d_out + rows * d_out, dtype=torch.float32, device="cpu")
        library().matvec_bf16(w.data_ptr(), x.data_ptr(), b, y.data_ptr(), scratch.data_ptr(), rows, d_out, d_in,
                              threads)
    return y


NORM_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension: CPU tensors of one of NORM_DTYPES,
    weight contiguous (bf16: normalised in fp32, rounded, then times the weight in bf16, as the model's
    own bf16 RMSNorm)."""
    if x.dtype not in NORM_DTYPES or weight.dtype != x.dtype or weight.numel() != x.shape[-1]:
        raise ValueError(f"native rms_norm: x {tuple(x.shape)} {x.dtype} and a weight of {weight.numel()} "
                         f"{weight.dtype}: expected one of {NORM_DTYPES} for both and a weight of {x.shape[-1]}")
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    kernel = library().rms_norm if x.dtype == torch.float32 else library().rms_norm_bf16
    kernel(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
           torch.get_num_threads())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, 1, D), rotate-half layout (ablate/model/rope.py) -> (T, H, D)."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), *x.shape, torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (T, 2F) = [gate | up] -> (T, F)."""
    gate_up = gate_up.contiguous()
    rows, f = gate_up.shape[0], gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], f, dtype=gate_up.dtype, device=gate_up.device)
    library().silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, f, torch.get_num_threads())
    return y
