"""nn.Linear whose CPU products each take the path chosen for their kind: timed once, or forced.

The paths: MKL through F.linear; oneDNN on W reordered once into its blocked layout (what Inductor's
CPU "freezing" does, done here eagerly); for one fp32 row, ablate's matrix-vector kernel on W packed
into its own layout (ablate/model/native/steps.c); and numpy's BLAS, for the products of a step
whose rows are all one (ablate/model/numpy_blas.py). Which is fastest depends on the machine and the
shape, so none is fixed in the code.

Keyed by what: one path per kind of product, (d_out, d_in, dtype, row class, torch threads). The row
classes are 1 row (a decode step at batch 1), 2-16 (a verify pass, a small decode batch), 17-128 and
more (prefills): a pass of 2 rows must not inherit the path timed on a 256-row prefill. The choices
are held by PRODUCT_PATHS (ablate/model/product_paths.py), with what is forced.

When, and what is timed: the first product of a kind times every path that can take it (two
warm-ups, then the median of 7 runs) and keeps the fastest for the process, unless the config's
`cpu_products` forces a path for its row class (then nothing is timed).
- Up to 16 rows (STREAMED_CLASS) a product is bound by reading W: it is timed over every live layer
  of its shape (up to MAX_TIMED_LAYERS), one after another, as a step streams them from memory; one
  weight run again and again would sit in the cache, where the ranking can flip. Past 16 rows a
  product reuses W across its rows (compute-bound): one layer times it.
- One-row products are chosen for every live shape at once (_choose_one_row): numpy's BLAS runs on a
  thread pool of its own, which cannot share a step with torch's, so either every product of a
  one-row step goes to numpy (the step lends it the cores: ProductPaths.one_row_step), or each takes
  the fastest of MKL, oneDNN and the native kernel. The totals decide; numpy is timed as it would
  run (torch on one thread), on the faster of two layouts of W (as stored, or a row-major copy).
A path that loses gives back the weight copies packed for its timing.

What is recorded: PRODUCT_PATHS.choices() lists every kind's path, whether one-row steps go to
numpy, the native kernels' state and `cpu_products`; every run writes it to environment.json
(`linear_paths`), and each arm's row in runs.csv counts the timings that ran inside it
(`path_timings`: a timing inside a timed round is in that round's time).

Layouts: one token is a matrix-vector product, and MKL's gemv streams W fastest when each input's row
of W^T is contiguous, so `input_major()` stores fp32 W as the transpose of a contiguous (d_in, d_out)
tensor (the same values, the strides swapped); bf16 W stays row-major (PyTorch's bf16 products on a
CPU without native bf16 are much slower on the transposed layout). The packed copies (oneDNN's, the
native kernel's, numpy's row-major one) are made on first use and remade whenever the weight changes
(a new tensor, or an in-place edit that bumps its version), so model variants that rewrite weights
stay correct. Each costs a copy of the weights in memory (copy_bytes, in every run's peak memory),
kept only for the paths chosen. GPU tensors, dtypes oneDNN cannot pack on this CPU (bf16 without
AVX-512 or AVX-NE-CONVERT) and cpu_products=mkl use plain F.linear.

What each path measured, on which machines: docs/cpu-products.md.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ablate.model import native, numpy_blas
from ablate.model.product_paths import MKL, NATIVE, ONEDNN, PRODUCT_PATHS, row_class


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT); the others take F.linear."""
    if not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


PACKABLE = _packable_dtypes()
MAX_TIMED_LAYERS = 64            # the most layers of one shape a path is timed over
STREAMED_CLASS = 1               # row classes up to this one (<= 16 rows) are bound by reading W


def copy_bytes(model: nn.Module) -> int:
    """Bytes of the weight copies `model`'s products keep beside the weights (the packed layouts of
    oneDNN and the native kernel, numpy's row-major copies): memory the model holds as it runs."""
    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            total += sum(c.numel() * c.element_size() for c in (m._packed, m._native_packed) if c is not None)
            total += m._numpy_wt.nbytes if m._numpy_wt is not None and m._numpy_rows else 0
    return total


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    fn()                       # warm-up: the packed copy, the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Changes when the weight does: its storage, and its version counter (inference tensors have none)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


class Linear(nn.Linear):
    """y = x W^T + b; on the CPU through MKL, a oneDNN-packed W, numpy's BLAS or the native kernel,
    whichever is fastest here or forced (see the module docstring)."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None
    _numpy_wt: np.ndarray | None = None
    _numpy_key: tuple[int, int] | None = None
    _numpy_rows = False        # numpy's products on a row-major copy of W (_numpy_layout)
    _native_packed: torch.Tensor | None = None
    _native_key: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        PRODUCT_PATHS.add_layer(self)

    def input_major(self) -> None:
        """Lay W out as W^T contiguous (see the module docstring); values and shape unchanged."""
        if self.weight.is_contiguous():
            with torch.no_grad():
                self.weight.data = self.weight.data.t().contiguous().t()    # (d_out, d_in), strides (1, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _eager_forward is not None and torch.compiler.is_compiling():
            # engine.graphs on a CPU compiles the arithmetic around the products; the products keep
            # the layouts above (Inductor's own CPU products ran this engine's batch-8 decode at half speed)
            return _eager_forward(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in PACKABLE or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        lent = PRODUCT_PATHS.lent
        if lent is not None and x.numel() == x.shape[-1]:
            return self._numpy(x)                          # a one-row step lent to numpy's BLAS
        threads = lent or torch.get_num_threads()
        key = (*w.shape, w.dtype, row_class(x.numel() // x.shape[-1]), threads)
        path = PRODUCT_PATHS.path_for(key) or self._choose(key, x)
        if path == NATIVE:
            return self._native(x, threads)
        return F.linear(x, w, self.bias) if path == MKL else self._onednn(x)

    def _choose(self, key: tuple, x: torch.Tensor) -> str:
        """The path for the first product of its kind (`key`): the forced one where it takes the product,
        else the fastest, timed now (one-row products: every live shape's at once, _choose_one_row)."""
        dtype, rows, threads = key[2:]
        forced = PRODUCT_PATHS.forced_path(rows)
        if forced in (MKL, ONEDNN) or (forced == NATIVE and dtype == torch.float32 and native.available()):
            path = forced
        else:
            if rows == 0 and not PRODUCT_PATHS.one_row_known(dtype, threads):
                _choose_one_row(dtype, threads)
            path = PRODUCT_PATHS.path_for(key) or self._faster_path(x, streamed=rows <= STREAMED_CLASS)
        PRODUCT_PATHS.keep(key, path)
        if rows == 0 and forced is not None:               # recorded: no timing decided it
            PRODUCT_PATHS.keep_one_row(dtype, threads, PRODUCT_PATHS.lends_one_row(dtype, threads))
        return path

    def _same_shape(self) -> list[Linear]:
        """This layer and every other live one of its shape, dtype, device and bias (up to MAX_TIMED_LAYERS)."""
        w = self.weight
        return [self] + [m for m in PRODUCT_PATHS.layers() if m is not self and m.weight.shape == w.shape
                         and m.weight.dtype == w.dtype and m.weight.device == w.device
                         and (m.bias is None) == (self.bias is None)][:MAX_TIMED_LAYERS - 1]

    def _faster_path(self, x: torch.Tensor, streamed: bool) -> str:
        """The fastest path for `x` (_time_paths): through every live layer shaped like this one when the
        product streams W (`streamed`), else through this one (the module docstring)."""
        return _time_paths(self._same_shape() if streamed else [self], x)[0]

    def _numpy(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b through numpy's BLAS, on W as stored or on a row-major copy (_numpy_layout)."""
        key = _weight_key(self.weight)
        if key != self._numpy_key:
            w = self.weight.detach()
            self._numpy_wt = (w.contiguous() if self._numpy_rows else w).numpy().T     # (d_in, d_out)
            self._numpy_key = key
        y = torch.from_numpy(x.reshape(-1, x.shape[-1]).numpy() @ self._numpy_wt)    # (T, d_out)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y.add_(self.bias)

    def _native(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """One row through the native kernel, on W packed into its layout (native.pack_rows)."""
        key = (*_weight_key(self.weight), *self.weight.shape)       # a new weight at a freed one's address
        if key != self._native_key:
            self._native_packed, self._native_key = native.pack_rows(self.weight), key
        return native.matvec(self._native_packed, x, self.bias, self.weight.shape[0], threads)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        key = _weight_key(w)
        if key != self._packed_key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)   # blocked
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _time_paths(layers: list[Linear], x: torch.Tensor) -> tuple[str, float]:
    """The fastest path for `x` through `layers`, and its time: MKL, oneDNN, or for one fp32 row the
    native kernel. A losing oneDNN or native kernel gives back the copies packed for its timing."""
    PRODUCT_PATHS.timed()
    packed_before = {id(m) for m in layers if m._packed is not None}
    seconds = {MKL: _median_seconds(lambda: [F.linear(x, m.weight, m.bias) for m in layers]),
               ONEDNN: _median_seconds(lambda: [m._onednn(x) for m in layers])}
    if x.numel() == x.shape[-1] and x.dtype == torch.float32 and native.available():
        threads = torch.get_num_threads()
        seconds[NATIVE] = _median_seconds(lambda: [m._native(x, threads) for m in layers])
    path = min(seconds, key=seconds.get)
    for m in layers:
        if path != ONEDNN and id(m) not in packed_before:
            m._packed = m._packed_key = None
        if path != NATIVE:
            m._native_packed = m._native_key = None
    return path, seconds[path]


def _choose_one_row(dtype: torch.dtype, threads: int) -> None:
    """Every live shape's one-row path, timed together: numpy's BLAS for all of them (a one-row step
    then lends it the cores: ablate/model/numpy_blas.py), or each the fastest of MKL, oneDNN and the
    native kernel. The two cannot mix in one step, so the totals decide; numpy is timed as it would
    run, with torch on one thread."""
    shapes = {}                # one layer per shape: the timing runs through every live layer of it
    for m in PRODUCT_PATHS.layers():
        if m.weight.device.type == "cpu" and m.weight.dtype == dtype:
            shapes.setdefault((*m.weight.shape, m.bias is None), m)
    inputs = {layer: torch.randn(1, layer.in_features, dtype=dtype, device="cpu") for layer in shapes.values()}
    timed = {layer: _time_paths(layer._same_shape(), x) for layer, x in inputs.items()}
    on_numpy = False
    if dtype == torch.float32 and numpy_blas.blas_threads(threads):
        time.sleep(0.01)       # torch's idle workers spin a while after their last parallel region
        with numpy_blas.torch_threads(1):
            numpy_seconds = sum(_numpy_layout(layer._same_shape(), x) for layer, x in inputs.items())
        on_numpy = numpy_seconds < sum(seconds for _, seconds in timed.values())
    PRODUCT_PATHS.keep_one_row(dtype, threads, on_numpy)
    for layer, (path, _) in timed.items():      # torch's path: for one-row products outside such a step
        PRODUCT_PATHS.keep((*layer.weight.shape, dtype, 0, threads), path)
        if not on_numpy:
            for m in layer._same_shape():
                m._numpy_wt = m._numpy_key = None


def _numpy_layout(layers: list[Linear], x: torch.Tensor) -> float:
    """numpy's time for `x` through `layers` on the faster of two layouts of W, which the layers keep:
    W^T as stored (no copy), or a row-major copy: OpenBLAS's kernels for the two differ by shape
    (docs/cpu-products.md)."""
    def lay_out(rows: bool) -> None:
        for m in layers:
            m._numpy_rows, m._numpy_key = rows, None          # made again at the next product

    def seconds(rows: bool) -> float:
        lay_out(rows)
        return _median_seconds(lambda: [m._numpy(x) for m in layers])

    as_stored, row_major = seconds(False), seconds(True)
    if as_stored <= row_major:
        lay_out(False)         # the copies go
    return min(as_stored, row_major)


# Linear._forward kept out of torch.compile; made on first use (products_stay_eager): importing
# torch._dynamo costs seconds, and imports triton before a test can ask for its interpreter
_eager_forward = None


def products_stay_eager() -> None:
    """Before torch.compile traces a model: its Linear products run eagerly, on the layouts above."""
    global _eager_forward
    if _eager_forward is None:
        _eager_forward = torch.compiler.disable(Linear._forward)
