"""Decode attention over a paged KV cache on the CPU (paged_attention.c), for attention=paged
(through ablate.api.native): each block is read where it lies, where the PyTorch path gathers every
sequence's blocks into padded K/V first and then runs one SDPA call over many one-query heads.
"""
from __future__ import annotations

import torch

from ablate.model.native.build import available, library, unavailable_reason

# paged_decode_attention keeps a task's running outputs (query heads x D) and one block's scores in
# arrays on its thread's stack: bounded so that they fit any thread's stack with room to spare
MAX_TASK_FLOATS = 32768
MAX_BLOCK_SIZE = 256      # paged_attention.c's MAX_BLOCK: the most keys of a block it scores at once


def paged_decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why paged_decode_attention cannot take these tensors, or None: q (B, H, D), caches
    (num_blocks, block_size, H_kv, D)."""
    if not available():
        return f"no native kernels ({unavailable_reason()})"
    if {q.device.type, k_cache.device.type, v_cache.device.type} != {"cpu"}:
        return "the native kernel runs on the CPU only"
    if {q.dtype, k_cache.dtype, v_cache.dtype} != {torch.float32}:
        return f"the native kernel takes fp32 only, got q {q.dtype} and a {k_cache.dtype} cache"
    if k_cache.shape != v_cache.shape or q.shape[-1] != k_cache.shape[-1]:
        return (f"the native kernel needs K and V of one width, that of the queries: q {tuple(q.shape)}, "
                f"K {tuple(k_cache.shape)}, V {tuple(v_cache.shape)}")
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        return f"{heads} query heads do not divide into {kv_heads} KV heads"
    if heads * q.shape[-1] > MAX_TASK_FLOATS:
        return f"{heads} query heads x D={q.shape[-1]} exceed the kernel's {MAX_TASK_FLOATS} floats a task"
    if k_cache.shape[1] > MAX_BLOCK_SIZE:
        return f"blocks of {k_cache.shape[1]} tokens exceed the kernel's {MAX_BLOCK_SIZE}"
    return None


def softmax_scale(dim: int) -> float:
    """The kernel's default scale of q . k: 1 / sqrt(D), as SDPA's."""
    return dim ** -0.5


def int32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int32, itself where it is (each cast or copy asked for costs a dispatch, ~1 us)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, threads: int, sm_scale: float | None = None) -> torch.Tensor:
    """One query per sequence over its blocks, read in place -> (B, H, D). q (B, H, D) fp32; caches
    (num_blocks, block_size, H_kv, D) fp32; block_tables (B, max_blocks) and context_lens (B) int32.
    The caller has checked paged_decode_problem()."""
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = int32(block_tables), int32(context_lens)
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    scale = softmax_scale(dim) if sm_scale is None else sm_scale
    library().paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                     lens.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[2], dim,
                                     k_cache.shape[1], tables.shape[1], scale, threads)
    return out
