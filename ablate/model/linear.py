"""nn.Linear whose CPU products each take the path chosen for their kind, on the weight where it lies.

The paths: MKL through F.linear; ablate's matrix-vector kernel for up to 16 rows of fp32 or bf16
(ablate/model/native/steps.c); numpy's BLAS, for the products of a step whose rows are all one
(ablate/model/numpy_blas.py); and oneDNN on W reordered into its blocked layout. Which is fastest
depends on the machine and the shape, so none is fixed in the code.

One copy of the weights: each path but oneDNN reads W where the model holds it, and the weight itself
is laid out for the path chosen: row-major (d_out, d_in), or input-major (the same values with W^T
contiguous, which MKL's gemv streams fastest on some machines). A change of layout is made in place,
one layer at a time, so the model never holds W twice. oneDNN's blocked layout is a copy beside W, so
it is timed only for bf16 products of more than 16 rows, which need it to reach the CPU's bf16 units;
otherwise it runs only when forced (copy_bytes counts it; every run's weight_copy_bytes column shows it).

Keyed by what: one path per kind of product, (d_out, d_in, dtype, row class, torch threads), and one
layout per (d_out, d_in, dtype). The row classes are 1 row (a decode step at batch 1), 2-16 (a
verify pass, a small decode batch), 17-128 and more (prefills): a pass of 2 rows must not inherit the
path timed on a 256-row prefill. The choices are held by PRODUCT_PATHS (ablate/model/product_paths.py),
with what is forced.

When, and what is timed: the first product of a kind times every path that can take it (two warm-ups,
then the median of 7 runs) and keeps the fastest for the process, unless the config's `cpu_products`
forces a path for its row class (then nothing is timed).
- Up to 16 rows (STREAMED_CLASS) a product is bound by reading W: it is timed over every live layer
  of its shape (up to MAX_TIMED_LAYERS), one after another, as a step streams them from memory; one
  weight run again and again would sit in the cache, where the ranking can flip. The first such
  kind of a shape times both layouts and settles the shape's layout; later kinds choose among the
  paths that read it.
- Past 16 rows a product reuses W across its rows (compute-bound): fp32 takes MKL on the layout held,
  untimed; bf16 times MKL against oneDNN on one layer.
- One-row products are chosen for every live shape at once (choose_one_row): numpy's BLAS runs on a
  thread pool of its own, which cannot share a step with torch's, so either every product of a
  one-row step goes to numpy (the step lends it the cores: ProductPaths.one_row_step), or each takes
  the fastest of torch's paths, or every one takes the native kernel, and the layers that can then
  run their dense arithmetic as native calls around them (ablate/model/native/layers.py). The totals
  decide, timed as a step runs: numpy lent the cores (torch on one thread), on both layouts, and
  torch's fastest path per shape, each product followed by the small operations a step runs before
  its next (path_timing.OPS_BETWEEN_PRODUCTS); the native kernel's products inside such layers
  (in_native_layer) back to back, as the native calls run them.
A oneDNN path that loses gives back the copies packed for its timing.

What is recorded: PRODUCT_PATHS.choices() lists every kind's path, every shape's layout, whether
one-row steps go to numpy, the native kernels' state and `cpu_products`; every run writes it to
environment.json (`linear_paths`), and each arm's row in runs.csv counts the timings that ran inside
it (`path_timings`: a timing inside a timed round is in that round's time).

Before any choice, fp32 weights are input-major (`input_major()`, at load) and bf16 weights row-major
(PyTorch's bf16 products on a CPU without native bf16 are much slower on the transposed layout). A
oneDNN copy is made on first use and remade whenever the weight changes (a new tensor, or an in-place
edit that bumps its version), so model variants that rewrite weights stay correct. GPU tensors, and
dtypes oneDNN cannot pack on this CPU (bf16 without AVX-512 or AVX-NE-CONVERT), use plain F.linear.

What each path measured, on which machines: docs/cpu-products.md.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ablate.model import native
from ablate.model.path_timing import (ONEDNN_TIMED, candidates, choose_one_row, layout_of, native_takes, settle,
                                      time_layouts)
from ablate.model.product_paths import (INPUT_MAJOR, MKL, NATIVE, NUMPY, ONEDNN, PRODUCT_PATHS, ROW_MAJOR,
                                        STREAMED_CLASS, row_class)


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT); the others take F.linear."""
    if not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


PACKABLE = _packable_dtypes()
MAX_TIMED_LAYERS = 64            # the most layers of one shape a path is timed over


def copy_bytes(model: nn.Module) -> int:
    """Bytes of the weight copies `model`'s products keep beside the weights (oneDNN's blocked
    layouts): memory the model holds as it runs. Every other path reads the weights in place."""
    return sum(m._packed.numel() * m._packed.element_size() for m in model.modules()
               if isinstance(m, Linear) and m._packed is not None)


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Changes when the weight does: its storage, and its version counter (inference tensors have none)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


class Linear(nn.Linear):
    """y = x W^T + b; on the CPU through MKL, the native kernel, numpy's BLAS or a oneDNN-packed W,
    whichever is fastest here or forced, on W laid out for it (see the module docstring)."""

    # set by the model on the products of a layer that can run as native calls around them
    # (DecoderLayer: ablate/model/native/layers.py), which the one-row timing weighs as such
    in_native_layer: bool = False
    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None
    _numpy_wt: np.ndarray | None = None
    _numpy_key: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        PRODUCT_PATHS.add_layer(self)

    def lay_out(self, layout: str) -> None:
        """Hold W row-major or input-major, in place: the same Parameter, values and shape; the old
        storage goes as the new one is made (one layer's worth of memory, for a moment)."""
        w = self.weight.data
        if layout_of(w) == layout:
            return
        # outside inference mode: a weight made inside it would be an inference tensor, which autograd
        # refuses wherever the model is used outside it afterwards
        with torch.inference_mode(False), torch.no_grad():
            self.weight.data = w.contiguous() if layout == ROW_MAJOR else w.t().contiguous().t()
        self._numpy_wt = self._numpy_key = None     # a view of the old storage would keep it alive
        PRODUCT_PATHS.changed()

    def input_major(self) -> None:
        """Lay W out as W^T contiguous (see the module docstring); values and shape unchanged."""
        self.lay_out(INPUT_MAJOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _eager_forward is not None and torch.compiler.is_compiling():
            # engine.graphs on a CPU compiles the arithmetic around the products; the products keep
            # the layouts above (Inductor's own CPU products ran this engine's batch-8 decode at half speed)
            return _eager_forward(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in PACKABLE or x.dtype != w.dtype or x.numel() == 0:
            return F.linear(x, w, self.bias)     # (no rows: a step whose sequences need no logits)
        lent = PRODUCT_PATHS.lent
        if lent is not None and x.numel() == x.shape[-1]:
            return self._numpy(x)                          # a one-row step lent to numpy's BLAS
        threads = lent or torch.get_num_threads()
        key = (*w.shape, w.dtype, row_class(x.numel() // x.shape[-1]), threads)
        path = PRODUCT_PATHS.path_for(key) or self._choose(key, x)
        return self._run(path, x, threads)

    def _run(self, path: str, x: torch.Tensor, threads: int) -> torch.Tensor:
        if path == NATIVE:
            return self._native(x, threads)
        if path == ONEDNN:
            return self._onednn(x)
        if path == NUMPY:
            return self._numpy(x)
        return F.linear(x, self.weight, self.bias)

    def _choose(self, key: tuple, x: torch.Tensor) -> str:
        """The path for the first product of its kind (`key`): the forced one where it takes the product,
        else the fastest, timed now (one-row products: every live shape's at once, choose_one_row)."""
        dtype, rows, threads = key[2:]
        forced = PRODUCT_PATHS.forced_path(rows)
        if forced in (MKL, ONEDNN) or (forced == NATIVE and native_takes(dtype, rows)):
            path = forced
        else:
            if rows == 0 and not PRODUCT_PATHS.one_row_known(dtype, threads):
                choose_one_row(dtype, threads)
            path = PRODUCT_PATHS.path_for(key) or self._faster_path(x, rows)
        PRODUCT_PATHS.keep(key, path)
        if rows == 0 and forced is not None:               # recorded: no timing decided it
            PRODUCT_PATHS.keep_one_row(dtype, threads, NUMPY if PRODUCT_PATHS.lends_one_row(dtype, threads) else "torch")
        return path

    def _shape_key(self) -> tuple:
        return (*self.weight.shape, self.weight.dtype)

    def _same_shape(self) -> list[Linear]:
        """This layer and every other live one of its shape, dtype, device and bias (up to MAX_TIMED_LAYERS)."""
        w = self.weight
        return [self] + [m for m in PRODUCT_PATHS.layers() if m is not self and m.weight.shape == w.shape
                         and m.weight.dtype == w.dtype and m.weight.device == w.device
                         and (m.bias is None) == (self.bias is None)][:MAX_TIMED_LAYERS - 1]

    def _faster_path(self, x: torch.Tensor, rows: int) -> str:
        """The fastest path for `x`: timed through every live layer shaped like this one when the
        product streams W, settling the shape's layout (time_layouts); past STREAMED_CLASS, MKL on
        the layout held (fp32) or the faster of MKL and oneDNN on this layer (bf16)."""
        dtype = self.weight.dtype
        if rows <= STREAMED_CLASS:
            layers = self._same_shape()
            seconds = time_layouts(layers, x, candidates(dtype, rows, PRODUCT_PATHS.layout_for(self._shape_key())))
            return settle(layers, seconds)[1]
        if dtype not in ONEDNN_TIMED:
            return MKL
        return settle([self], time_layouts([self], x, [(ROW_MAJOR, MKL), (ROW_MAJOR, ONEDNN)]))[1]

    def _numpy(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b through numpy's BLAS, on W as it lies (a view, not a copy)."""
        key = _weight_key(self.weight)
        if key != self._numpy_key:
            self._numpy_wt = self.weight.detach().numpy().T        # (d_in, d_out)
            self._numpy_key = key
        y = torch.from_numpy(x.reshape(-1, x.shape[-1]).numpy() @ self._numpy_wt)    # (T, d_out)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y.add_(self.bias)

    def _native(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """A few rows through the native kernel, which reads W row-major (a layer made after its shape's
        layout was settled is laid out now)."""
        if not self.weight.is_contiguous():
            self.lay_out(ROW_MAJOR)
        return native.matvec(self.weight, x, self.bias, threads)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        key = _weight_key(w)
        if key != self._packed_key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)   # blocked
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


# Linear._forward kept out of torch.compile; made on first use (products_stay_eager): importing
# torch._dynamo costs seconds, and imports triton before a test can ask for its interpreter
_eager_forward = None


def products_stay_eager() -> None:
    """Before torch.compile traces a model: its Linear products run eagerly, on the layouts above."""
    global _eager_forward
    if _eager_forward is None:
        _eager_forward = torch.compiler.disable(Linear._forward)
