"""A decoder layer's dense arithmetic in two native calls (layers.c): before the cache, the attention
norm, the QKV product and RoPE; after the attention, the output product, the residual, the MLP norm,
SwiGLU and the second residual. The KV cache and the attention stay the arm's own slots, called
between the two. The calls run the kernels the layer's eager path runs (steps.c), in its order, so they
give the same bits: what they save is the Python between the products.

A LayerCalls binds one layer's weights once (checked, and held, so that their pointers stay valid);
each call then passes only the step's own tensors. The caller (ablate/model/native_plan.py) makes them
only where the eager path would run these kernels: fp32 on the CPU, every product of the layer on the
native path for its row count, and makes them again whenever a path or a layout changes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ablate.model.native.attention import MAX_BLOCK_SIZE, int32, softmax_scale
from ablate.model.native.build import library

if TYPE_CHECKING:
    from ablate.api.kv import PagedPlaces


def _check(what: str, dtype: torch.dtype, **tensors: tuple[torch.Tensor | None, tuple[int, ...]]) -> None:
    """The C code trusts its pointers: each tensor must be contiguous, of `dtype` on the CPU and of the
    shape given (None: an absent bias), else it would read past an end. A ValueError names the first
    that is not."""
    for name, (t, shape) in tensors.items():
        if t is not None and (t.shape != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"native {what}: {name} is {tuple(t.shape)} {t.dtype} on {t.device} (contiguous: "
                             f"{t.is_contiguous()}), expected a contiguous {shape} {dtype} on the CPU")


class LayerCalls:
    """One decoder layer's two native calls, its weights bound: W_qkv ((H + 2 H_kv) D, d) and its bias
    or None, W_o (d, H D), W_gate_up (2 F, d), W_down (d, F), the two norms' weights (d) and epsilons."""

    def __init__(self, attn_norm: torch.Tensor, attn_eps: float, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
                 w_o: torch.Tensor, mlp_norm: torch.Tensor, mlp_eps: float, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, heads: int, kv_heads: int, dim: int, threads: int) -> None:
        d, f = w_down.shape
        self.width = (heads + 2 * kv_heads) * dim               # a row of QKV
        _check("layer", w_qkv.dtype, attn_norm=(attn_norm, (d,)), w_qkv=(w_qkv, (self.width, d)),
               b_qkv=(b_qkv, (self.width,)), w_o=(w_o, (d, heads * dim)), mlp_norm=(mlp_norm, (d,)),
               w_gate_up=(w_gate_up, (2 * f, d)), w_down=(w_down, (d, f)))
        self.held = (attn_norm, w_qkv, b_qkv, w_o, mlp_norm, w_gate_up, w_down)    # their pointers below stay valid
        self.d, self.f, self.heads, self.kv_heads, self.dim, self.dtype = d, f, heads, kv_heads, dim, w_qkv.dtype
        self.qkv_args = (attn_norm.data_ptr(), attn_eps, w_qkv.data_ptr(), None if b_qkv is None else b_qkv.data_ptr())
        self.out_mlp_args = (w_o.data_ptr(), mlp_norm.data_ptr(), mlp_eps, w_gate_up.data_ptr(), w_down.data_ptr())
        self.threads = threads
        self.dims = (d, heads, kv_heads, dim, f, threads)
        # per row, for any call: q, k, v and the attention's output of a whole layer's call, then either half's
        self.scratch_floats = self.width + heads * dim + max(d + self.width, 2 * d + 3 * f)

    def outputs(self, t: int, layers: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New q (L, T, H, D), k and v (L, T, H_kv, D) for qkv to write, layer i's at [i], for L = `layers`
        layers of this shape: new each step, as the cache may keep k and v. Made for the whole step before
        its first product: made a layer at a time between two products, the same Python took 40 us a
        layer on the caches the weights had emptied. A layer takes its own only when it runs two calls
        (a layer in one call writes them in its scratch)."""
        return tuple(torch.empty(layers, t, heads, self.dim, dtype=self.dtype, device="cpu")
                     for heads in (self.heads, self.kv_heads, self.kv_heads))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor,
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """x (T, d) -> out: q (T, H, D) and k (T, H_kv, D) rotated by cos, sin (T, 1, D), and v (T, H_kv, D),
        of rms_norm(x) W_qkv^T (+ b). out: from outputs(T); scratch: T x scratch_floats floats of the
        step's. The caller checked x, cos, sin and scratch (check_step)."""
        q, k, v = out
        library().layer_qkv(x.data_ptr(), *self.qkv_args, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                            v.data_ptr(), scratch.data_ptr(), x.shape[0], self.d, self.heads, self.kv_heads, self.dim,
                            self.threads)

    def out_mlp(self, x: torch.Tensor, attn: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """x (T, d), attn (T, H, D) -> h + down(silu(gate) * up) with h = x + attn W_o^T and gate, up the
        halves of rms_norm(h) W_gate_up^T: the layer's output (T, d), written over x and returned."""
        t = x.shape[0]
        attn = attn.contiguous()
        if attn.shape != (t, self.heads, self.dim) or attn.dtype != self.dtype:     # the attention plugin's output
            raise ValueError(f"native layer: attn is {tuple(attn.shape)} {attn.dtype}, expected "
                             f"{(t, self.heads, self.dim)} {self.dtype}")
        library().layer_out_mlp(x.data_ptr(), attn.data_ptr(), *self.out_mlp_args, x.data_ptr(), scratch.data_ptr(), t,
                                self.d, self.heads * self.dim, self.f, self.threads)
        return x

    def paged_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor,
                     cache: tuple) -> torch.Tensor:
        """The whole layer of a decode step on a paged cache read by the native paged kernel, in one call:
        qkv, k and v copied to their slots of the layer's pools, the attention over them, out_mlp. x (T, d)
        written over and returned; cache: the layer's arguments from PagedDecode.of."""
        library().layer_paged_decode(x.data_ptr(), *self.qkv_args, cos.data_ptr(), sin.data_ptr(), *cache,
                                     *self.out_mlp_args, x.data_ptr(), scratch.data_ptr(), x.shape[0], *self.dims)
        return x

    def check_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor) -> None:
        """What qkv and out_mlp take of a step, checked once a step for every layer it fits (the model
        makes them and passes the same tensors to each layer)."""
        t = x.shape[0]
        _check("layer", self.dtype, x=(x, (t, self.d)), cos=(cos, (t, 1, self.dim)), sin=(sin, (t, 1, self.dim)),
               scratch=(scratch, (t * self.scratch_floats,)))


class PagedDecode(NamedTuple):
    """A decode step's paged cache as layer_paged_decode takes it, checked once a step: per layer, the
    pointers of its K and V pools, its rows' slots, its block tables and the step's context lengths,
    with the block size, the tables' width and the scale; `held` keeps what they point to."""
    layers: list[tuple]
    held: tuple

    @classmethod
    def of(cls, calls: LayerCalls, places: PagedPlaces, kv_lens: torch.Tensor, rows: int,
           layers: int) -> PagedDecode | None:
        """From KVCache.paged_slots' places and the step's kv_lens_t, for `rows` sequences of one query
        each in a model of `layers` layers, or None where they are not what the kernels take (the C code
        trusts them): fp32 pools (P, N, bs, H_kv, D) of the layers' shape, slots (G, rows) int64 inside a
        pool, block tables (G, rows, width) int32, a pool and group among them for every layer."""
        k, v, slots, tables, lens = places.k, places.v, places.slot_mapping, places.block_tables, int32(kv_lens)
        pools, n, bs = k.shape[0], k.shape[1], k.shape[2]
        groups = slots.shape[0]
        if (k.shape != (pools, n, bs, calls.kv_heads, calls.dim) or v.shape != k.shape or bs > MAX_BLOCK_SIZE
                or {k.dtype, v.dtype} != {torch.float32} or slots.dtype != torch.long or tables.dtype != torch.int32
                or slots.shape != (groups, rows) or tables.shape[:2] != (groups, rows) or tables.dim() != 3
                or lens.shape != (rows,)
                or not all(t.is_contiguous() and t.device.type == "cpu" for t in (k, v, slots, tables, lens))
                or len(places.layers) != layers or not all(0 <= p < pools and 0 <= g < groups for p, g in places.layers)
                or rows and not 0 <= int(slots.min()) <= int(slots.max()) < n * bs):
            return None
        scale, width = softmax_scale(calls.dim), tables.shape[2]
        pool_bytes, slots_bytes, tables_bytes = k[0].nbytes, rows * slots.itemsize, rows * width * tables.itemsize
        args = [(k.data_ptr() + p * pool_bytes, v.data_ptr() + p * pool_bytes, slots.data_ptr() + g * slots_bytes,
                 tables.data_ptr() + g * tables_bytes, lens.data_ptr(), bs, width, scale) for p, g in places.layers]
        return cls(args, (k, v, slots, tables, lens))
