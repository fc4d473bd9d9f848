"""nn.Linear that runs each CPU product on whichever of two paths is faster on this machine.

A CPU product can go to MKL through `F.linear`, or to oneDNN on the weight reordered once into its
blocked layout (what Inductor's CPU "freezing" does; here done eagerly, without compiling anything).
Which is faster depends on the machine and the shape, so neither is fixed in the code: the first
product of each (weight shape, dtype, class of row count, thread count) times both (median of 7
after warm-up) and keeps the faster for the process; `linear_paths()` lists the choices and every
run records them (environment.json). Measured on SmolLM2's shapes, 2 cores: on an AVX2 EPYC oneDNN
ran 2-128-token products about twice as fast as MKL (4 tokens 127 -> 51 ms for the 121 products of
one forward) while MKL's matrix-vector path won at one token; on a Zen 5 EPYC oneDNN won at one
token too (a decode step 30 -> 16.5 ms); on another AVX-512 EPYC MKL won at one token again.

Products of up to 16 rows are bound by reading W, so both paths are timed as a step meets them:
over every live layer of that shape (up to MAX_TIMED_LAYERS), one after another, not one weight again
and again. A model's 30 copies of a 2 MB weight stream from DRAM in a decode step; a single one,
repeated, sits in the cache, where the ranking can flip: timed on one cache-hot weight, MKL won
SmolLM2's decode products that oneDNN ran 1.2-1.9x faster from DRAM (a Zen 4 EPYC: 44 -> 37 ms a
step, benchmarks/decode_profile.py). Larger products reuse each weight across their rows
(compute-bound), so one layer times them: a 64-request prefill of 8192 rows timed over 30 layers
took minutes.

Row classes (ROW_CLASSES): 1 row (a decode step at batch 1), up to 16 (a verify pass of k drafts, a
small decode batch), up to 128, and more (prefills). A pass of 2 rows must not inherit the path
timed on a 256-row prefill: on one thread of a Zen 5 EPYC, MKL ran SmolLM2's 1728 x 576 product
in the same 73 us as oneDNN at one row, but in 155 us against oneDNN's 76 us at two.

One token (a decode step at batch 1) is a matrix-vector product, bound by reading W once. MKL's gemv
streams W fastest when each input's row of W^T is contiguous: `input_major()` stores W as the
transpose of a contiguous (d_in, d_out) tensor (the same values, the strides swapped), so F.linear
becomes y = x @ W^T over contiguous memory (55 -> 40 ms for SmolLM2's 121 products on 2 cores). fp32
only: PyTorch's bf16 products on a CPU without native bf16 are ~10x slower on the transposed layout.

The packed copy is made on first use and remade whenever the weight changes (a new tensor, or an
in-place edit that bumps its version), so model variants that rewrite weights stay correct. It
costs a second copy of each weight in memory; GPU tensors, dtypes oneDNN cannot pack on this CPU
(bf16 without AVX-512 or AVX-NE-CONVERT) and `ABLATE_PACKED_LINEAR=0` use plain F.linear.
"""
from __future__ import annotations

import bisect
import os
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    if os.environ.get("ABLATE_PACKED_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


PACKABLE = _packable_dtypes()
MKL, ONEDNN = "mkl", "onednn"
_paths: dict[tuple, str] = {}    # (d_out, d_in, dtype, row class, threads) -> the faster path, timed once
ROW_CLASSES = (1, 16, 128)       # upper bounds: 1 row, 2-16, 17-128, more
MAX_TIMED_LAYERS = 64            # the most layers of one shape a path is timed over
STREAMED_CLASS = 1               # row classes up to this one (<= 16 rows) are bound by reading W
_live: weakref.WeakSet[Linear] = weakref.WeakSet()    # every Linear alive: the layers a choice is timed on


def row_class(rows: int) -> int:
    """The class of a product's row count whose path is timed on its own: an index into ROW_CLASSES
    (one past its end for more rows). A bisection: this runs for every product of every step."""
    return bisect.bisect_left(ROW_CLASSES, rows)


def row_class_name(index: int) -> str:
    """'1', '2-16', '17-128', '129+'."""
    low = 1 if index == 0 else ROW_CLASSES[index - 1] + 1
    if index == len(ROW_CLASSES):
        return f"{low}+"
    high = ROW_CLASSES[index]
    return str(high) if low == high else f"{low}-{high}"


def linear_paths() -> dict[str, str]:
    """The paths chosen in this process, for the results: "d_out x d_in dtype R rows threads" -> path."""
    return {f"{o}x{i} {str(dtype).removeprefix('torch.')} {row_class_name(rows)} rows {threads} threads": path
            for (o, i, dtype, rows, threads), path in sorted(_paths.items(), key=str)}


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
    """y = x W^T + b; on the CPU through MKL or a oneDNN-packed W, whichever is faster here (see the
    module docstring)."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _live.add(self)

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
        key = (*w.shape, w.dtype, row_class(x.numel() // x.shape[-1]), torch.get_num_threads())
        path = _paths.get(key)
        if path is None:       # the first product of its kind: time both paths, keep the faster
            path = _paths[key] = self._faster_path(x, streamed=key[3] <= STREAMED_CLASS)
        return F.linear(x, w, self.bias) if path == MKL else self._onednn(x)

    def _faster_path(self, x: torch.Tensor, streamed: bool) -> str:
        """MKL or oneDNN, timed on `x`: through every live layer shaped like this one when the product
        streams W (`streamed`), else through this one (the module docstring)."""
        w = self.weight
        layers = [self] + [m for m in list(_live) if streamed and m is not self and m.weight.shape == w.shape
                           and m.weight.dtype == w.dtype and m.weight.device == w.device
                           and (m.bias is None) == (self.bias is None)][:MAX_TIMED_LAYERS - 1]
        packed_before = {id(m) for m in layers if m._packed is not None}
        mkl = _median_seconds(lambda: [F.linear(x, m.weight, m.bias) for m in layers])
        onednn = _median_seconds(lambda: [m._onednn(x) for m in layers])
        if mkl <= onednn:
            for m in layers:           # packed for the timing only: give those copies back
                if id(m) not in packed_before:
                    m._packed = m._packed_key = None
        return MKL if mkl <= onednn else ONEDNN

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
