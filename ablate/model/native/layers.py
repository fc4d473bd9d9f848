"""A decoder layer's dense arithmetic in two native calls (layers.c): before the cache, the attention
norm, the QKV product and RoPE; after the attention, the output product, the residual, the MLP norm,
SwiGLU and the second residual. The KV cache and the attention stay the arm's own slots, called
between the two. The calls run the kernels the layer's eager path runs (steps.c), in its order, so they
give the same bits: what they save is the twenty-odd Python calls between the products.

The caller (ablate/model/llama.py) takes this path only where the eager one would run these kernels:
fp32 on the CPU, every product of the layer on the native path for its row count.
"""
from __future__ import annotations

import torch

from ablate.model.native.build import library


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(what: str, dtype: torch.dtype, **tensors: tuple[torch.Tensor | None, tuple[int, ...]]) -> None:
    """The C code trusts its pointers: each tensor must be contiguous, of `dtype` on the CPU and of the
    shape given (None: an absent bias), else it would read past an end. A ValueError names the first
    that is not."""
    for name, (t, shape) in tensors.items():
        if t is not None and (t.shape != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"native {what}: {name} is {tuple(t.shape)} {t.dtype} on {t.device} (contiguous: "
                             f"{t.is_contiguous()}), expected a contiguous {shape} {dtype} on the CPU")


def layer_qkv(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
              cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, dim: int,
              threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, d) -> q (T, H, D), k (T, H_kv, D) rotated by cos, sin (T, 1, D), and v (T, H_kv, D), from
    rms_norm(x) W_qkv^T (+ b). Every tensor contiguous fp32 on the CPU (the caller checked). q, k and v
    are new tensors, since the cache may keep k and v; one allocation holds them and the scratch."""
    t, d = x.shape
    width = (heads + 2 * kv_heads) * dim
    _check("layer_qkv", x.dtype, x=(x, (t, d)), norm=(norm_w, (d,)), w_qkv=(w_qkv, (width, d)),
           bias=(b_qkv, (width,)), cos=(cos, (t, 1, dim)), sin=(sin, (t, 1, dim)))
    out = torch.empty(t * (width + d + width), dtype=x.dtype)
    q, k, v, scratch = out.split((t * heads * dim, t * kv_heads * dim, t * kv_heads * dim, t * (d + width)))
    library().layer_qkv(x.data_ptr(), norm_w.data_ptr(), eps, w_qkv.data_ptr(), _ptr(b_qkv), cos.data_ptr(),
                        sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), scratch.data_ptr(), t, d, heads,
                        kv_heads, dim, threads)
    return q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)


def layer_out_mlp(x: torch.Tensor, attn: torch.Tensor, w_o: torch.Tensor, norm_w: torch.Tensor, eps: float,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor, threads: int) -> torch.Tensor:
    """x (T, d), attn (T, H, D) -> h + down(silu(gate) * up) with h = x + attn W_o^T and gate, up the
    halves of rms_norm(h) W_gate_up^T: the layer's output (T, d), written over x and returned."""
    t, d = x.shape
    f = w_down.shape[1]
    attn = attn.contiguous()
    q_size = attn.numel() // max(t, 1)
    _check("layer_out_mlp", x.dtype, x=(x, (t, d)), attn=(attn, (t, *attn.shape[1:])), w_o=(w_o, (d, q_size)),
           norm=(norm_w, (d,)), w_gate_up=(w_gate_up, (2 * f, d)), w_down=(w_down, (d, f)))
    scratch = torch.empty(t * (2 * d + 3 * f), dtype=x.dtype)
    library().layer_out_mlp(x.data_ptr(), attn.data_ptr(), w_o.data_ptr(), norm_w.data_ptr(), eps,
                            w_gate_up.data_ptr(), w_down.data_ptr(), x.data_ptr(), scratch.data_ptr(), t, d,
                            q_size, f, threads)
    return x
