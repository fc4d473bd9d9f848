"""Which decoder layers of a step run as native calls (ablate/model/native/layers.py), and the
buffers a step's calls share: two calls around the arm's cache and attention, or, on a decode step
whose cache and attention offer it (Forward.paged_places), one call with their work inside.

A layer runs so only where its eager path would run the same kernels in the same order, so that the
choice changes no bit of the output: a plain Llama layer (DecoderLayer.native_calls_fit), fp32 on
the CPU, every one of its four products on the native path for the step's row class (timed or
forced: ablate/model/linear.py), outside torch.compile (engine.graphs) and outside a one-row step
lent to numpy's BLAS. A plan says so for every layer; it is made once and kept until a product's
path, a weight's layout or what is forced changes (PRODUCT_PATHS.generation). Checked in each layer
between its products, as first written, the same Python took 60 us a layer on an AVX2 EPYC, on
caches the weights had just emptied: a sixth of the step (docs/cpu-products.md). A weight replaced
in a module without either (`linear.weight = ...`) is not seen until then: the plan holds the old one.

The layer itself is still called as a module (its hooks see it, as the host-sync counter's do); a
layer with a hook on a module inside it (a norm, the attention, a product: calibration's, a user's),
or any global module hook, runs eagerly, as the hook expects to see that module called.
"""
from __future__ import annotations

import unittest.mock
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.nn.modules import module as nn_module

from ablate.model import native
from ablate.model.forward import Forward
from ablate.model.linear import Linear
from ablate.model.native.layers import LayerCalls, PagedDecode
from ablate.model.product_paths import NATIVE, PRODUCT_PATHS, row_class

if TYPE_CHECKING:
    from torch import nn

    from ablate.api.packing import LayerAttention

Rope = tuple[torch.Tensor, torch.Tensor]        # cos, sin (T, 1, D)
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
PAGED_DECODE = "native/paged_decode"     # a step's memo: its PagedDecode, or None


def layer_calls(layer: nn.Module, dtype: torch.dtype, rows: int, threads: int) -> LayerCalls | None:
    """A DecoderLayer's dense arithmetic as two native calls for `dtype` rows of row class `rows`, or
    None where its eager path would compute otherwise (see the module docstring)."""
    attn, mlp = layer.attn, layer.mlp
    if not layer.native_calls_fit() or layer.attn_norm.weight.dtype != dtype or layer.mlp_norm.weight.dtype != dtype:
        return None
    for linear in (attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down):
        w = linear.weight
        if (type(linear) is not Linear or not w.is_contiguous() or (linear.bias is not None and linear is not attn.wqkv)
                or PRODUCT_PATHS.path_for((*w.shape, w.dtype, rows, threads)) != NATIVE):
            return None
    return LayerCalls(layer.attn_norm.weight, layer.attn_norm.eps, attn.wqkv.weight, attn.wqkv.bias, attn.wo.weight,
                      layer.mlp_norm.weight, layer.mlp_norm.eps, mlp.w_gate_up.weight, mlp.w_down.weight,
                      attn.n_heads, attn.n_kv_heads, attn.head_dim, threads)


@dataclass(frozen=True)
class NativeLayer:
    """A layer of a plan: its two calls, what its slots are given, and its modules' hooks."""
    calls: LayerCalls
    index: int                          # the layer's index, for the cache and the attention
    features: LayerAttention | None     # its window or soft cap, for the attention
    hooks: tuple[dict, ...]             # the forward (pre-)hooks of the modules inside it, as torch holds them


class NativeStep(NamedTuple):
    """A layer's native calls in one step, given to DecoderLayer.forward: the step's scratch, and every
    layer's q, k, v (LayerCalls.outputs), of which this layer's are at [layer.index]."""
    layer: NativeLayer
    scratch: torch.Tensor
    qkv: QKV

    def forward(self, x: torch.Tensor, rope: Rope, fwd: Forward) -> torch.Tensor:
        """DecoderLayer.forward's result, its x (T, d) written over: the two calls around the arm's cache
        and attention, or, after a layer that called them on a decode step where both offer it, one call
        with their work inside (PagedDecode)."""
        calls, index = self.layer.calls, self.layer.index
        if fwd.native_layers and self.layer.features is None:    # a layer before this one called the slots
            paged = fwd.step.memo(PAGED_DECODE, lambda: self._paged_decode(fwd, x.shape[0]))
            if paged is not None:
                fwd.native_layers += 1
                fwd.one_call_layers += 1
                return calls.paged_decode(x, *rope, self.scratch, paged.layers[index])
        q, k, v = qkv = tuple(t[index] for t in self.qkv)
        calls.qkv(x, *rope, self.scratch, qkv)
        out = fwd.attend(index, q, fwd.store(index, k, v), self.layer.features)       # (T, H, D)
        fwd.native_layers += 1
        return calls.out_mlp(x, out, self.scratch)

    def _paged_decode(self, fwd: Forward, rows: int) -> PagedDecode | None:
        """The step's paged cache for whole-layer calls, where the arm's cache and attention offer it."""
        places = fwd.paged_places()
        layers = self.qkv[0].shape[0]       # the model's, as outputs() made them
        return None if places is None else PagedDecode.of(self.layer.calls, places, fwd.step.kv_lens_t, rows, layers)


@dataclass(frozen=True)
class NativePlan:
    layers: tuple[NativeLayer | None, ...]    # per decoder layer; None: it runs eagerly
    widest: LayerCalls        # the calls needing the most scratch: its checks and outputs serve them all

    def step(self, x: torch.Tensor, rope: Rope, local: Rope) -> list[NativeStep | None]:
        """Each layer's calls for this step: x (T, d), the RoPE tables (T, 1, D) of the full and the
        windowed layers, all contiguous; every layer's q, k, v made at once, before the first product
        (LayerCalls.outputs)."""
        scratch = torch.empty(x.shape[0] * self.widest.scratch_floats, dtype=x.dtype, device=x.device)
        self.widest.check_step(x, *rope, scratch)
        if local[0] is not rope[0] or local[1] is not rope[1]:
            self.widest.check_step(x, *local, scratch)
        qkv = self.widest.outputs(x.shape[0], len(self.layers))
        return [None if n is None or any(n.hooks) else NativeStep(n, scratch, qkv) for n in self.layers]


def two_calls_only():
    """A context in which no layer runs in one call (every native layer calls the cache and the attention
    between its two): for the conformance kit, which checks those calls, and for timing one way against
    the other."""
    return unittest.mock.patch.object(Forward, "paged_places", lambda self: None)


class NativePlans:
    """A model's plans, by what they depend on: (PRODUCT_PATHS.generation, dtype, row class, threads,
    the number of layers)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, NativePlan | None] = {}

    def for_step(self, layers: nn.ModuleList, x: torch.Tensor, fwd: Forward) -> NativePlan | None:
        """The plan for a step of input x (T, d) through the model's `layers`; None where none runs natively."""
        if (fwd.compile or x.shape[0] > native.SMALL_ROWS or not native.takes(x) or PRODUCT_PATHS.lent is not None
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks):
            return None
        threads, rows = torch.get_num_threads(), row_class(x.shape[0])
        key = (PRODUCT_PATHS.generation, x.dtype, rows, threads, len(layers))
        if key not in self._plans:
            plan = _plan(layers, x.dtype, rows, threads)
            self._plans = {k: v for k, v in self._plans.items() if k[0] == key[0]} | {key: plan}
        return self._plans[key]


def _plan(decoder_layers: nn.ModuleList, dtype: torch.dtype, rows: int, threads: int) -> NativePlan | None:
    layers = []
    for i, layer in enumerate(decoder_layers):
        calls = layer_calls(layer, dtype, rows, threads)
        hooks = tuple(h for m in layer.modules() if m is not layer for h in (m._forward_pre_hooks, m._forward_hooks))
        layers.append(None if calls is None else NativeLayer(calls, i, layer.attn.features, hooks))
    calls = [n.calls for n in layers if n is not None]
    if not calls:
        return None
    widest = max(calls, key=lambda c: c.scratch_floats)
    # one check and one allocation a step serve every layer: they take x, the RoPE tables, the scratch
    # and q, k, v alike
    same = len({(c.d, c.heads, c.kv_heads, c.dim, c.dtype) for c in calls}) == 1
    return NativePlan(tuple(layers), widest) if same else None
