"""How the path of a kind of CPU product and the layout of a shape's weights are chosen: by the clock.

What is timed, when, and why is in ablate/model/linear.py's docstring; this module holds the timing
itself, over the Linear layers it is handed (their `_run(path, x, threads)`, `lay_out(layout)`,
`_same_shape()` and `_shape_key()`), and records what won in PRODUCT_PATHS.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ablate.model import native, numpy_blas
from ablate.model.product_paths import (INPUT_MAJOR, MKL, NATIVE, NUMPY, ONEDNN, PRODUCT_PATHS, ROW_MAJOR,
                                        STREAMED_CLASS)

# dtypes whose products past 16 rows time oneDNN, a copy of W beside it: bf16, whose compute-bound
# products reach the CPU's bf16 units (AMX, AVX512-BF16) through it. Products of up to 16 rows are bound
# by reading W, which no unit speeds up, and fp32 has paths as fast that read W in place
# (docs/cpu-products.md): for those oneDNN runs only when forced.
ONEDNN_TIMED = (torch.bfloat16,)
# A decode step runs a few small operations between two products (norms, RoPE, attention, residual adds:
# SmolLM2's step makes ~270 module calls around its 121 products). Whether a one-row step goes to numpy's
# BLAS is timed with this many after each product, as in a step: numpy's pool, lent the cores, wakes
# for each product, which back-to-back products hide (on an AVX2 EPYC numpy ran level with the native
# kernel back to back and lost by a third in steps: docs/cpu-products.md). Between torch's own paths,
# which share one pool, the products are timed back to back: the small operations only add noise there.
OPS_BETWEEN_PRODUCTS = 3


def layout_of(w: torch.Tensor) -> str:
    """ROW_MAJOR (W contiguous), INPUT_MAJOR (W^T contiguous) or "strided"."""
    if w.is_contiguous():
        return ROW_MAJOR
    return INPUT_MAJOR if w.t().is_contiguous() else "strided"


def native_takes(dtype: torch.dtype, rows_class: int) -> bool:
    """Whether the native kernel takes products of this dtype and row class (fp32 or bf16, up to 16 rows)."""
    return dtype in native.MATVEC_DTYPES and rows_class <= STREAMED_CLASS and native.available()


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    fn()                       # warm-up: the packed copy, the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def candidates(dtype: torch.dtype, rows: int, held: str | None) -> list[tuple[str, str]]:
    """The (layout, path) pairs a streamed product of this dtype and row class may take: on the layout
    `held` when the shape's is settled, else on each layout the dtype may take (fp32: both)."""
    layouts = [held] if held else [ROW_MAJOR, INPUT_MAJOR] if dtype == torch.float32 else [ROW_MAJOR]
    pairs = []
    for layout in layouts:
        pairs.append((layout, MKL))
        if layout == ROW_MAJOR and native_takes(dtype, rows):
            pairs.append((layout, NATIVE))
    return pairs


def lay_out_all(layers: list, layout: str) -> None:
    for m in layers:
        m.lay_out(layout)


def product_then(layer, path: str, x: torch.Tensor, threads: int, between: int) -> None:
    """`x` through `layer` on `path`, then `between` small operations on its output, as a step runs them."""
    y = layer._run(path, x, threads)
    for _ in range(between):
        F.rms_norm(y, y.shape[-1:])


def time_layouts(layers: list, x: torch.Tensor, pairs: list[tuple[str, str]],
                 between: int = 0) -> dict[tuple[str, str], float]:
    """Seconds for `x` through `layers` on each (layout, path) of `pairs`, each product followed by
    `between` small operations (then over more repeats: they add the noise of the operations' own
    times), the layers laid out in place for each layout in turn (they end on the last)."""
    PRODUCT_PATHS.timed()
    threads = torch.get_num_threads()
    repeats = 15 if between else 7
    seconds = {}
    for layout in dict.fromkeys(layout for layout, _ in pairs):
        lay_out_all(layers, layout)
        for pair in [p for p in pairs if p[0] == layout]:
            seconds[pair] = median_seconds(lambda: [product_then(m, pair[1], x, threads, between) for m in layers],
                                           repeats)
    return seconds


def settle(layers: list, seconds: dict[tuple[str, str], float]) -> tuple[str, str]:
    """The fastest (layout, path) of `seconds`: `layers` laid out for it and the shape's layout recorded;
    oneDNN copies made only for this timing are given back when it lost."""
    layout, path = min(seconds, key=seconds.get)
    lay_out_all(layers, layout)
    PRODUCT_PATHS.keep_layout(layers[0]._shape_key(), layout)
    if path != ONEDNN and not PRODUCT_PATHS.uses(layers[0]._shape_key(), ONEDNN):
        for m in layers:
            m._packed = m._packed_key = None
    return layout, path


def choose_one_row(dtype: torch.dtype, threads: int) -> None:
    """Every live shape's one-row path, timed together, one of three ways a one-row step can run
    (ONE_ROW_WAYS): numpy's BLAS for all of them (a one-row step then lends it the cores:
    ablate/model/numpy_blas.py); each the fastest of torch's paths; or the native kernel for all of
    them, where the layers then run their dense arithmetic as native calls around the products
    (ablate/model/native/layers.py). They cannot mix in one step, so the totals decide, each way timed
    as a step runs it: a product run from Python is followed by a step's small operations
    (OPS_BETWEEN_PRODUCTS), one inside a layer's native calls (Linear.in_native_layer) by none.
    numpy is timed as it would run, with torch on one thread. Each shape's layout is the one its
    winning path was fastest on."""
    shapes = {}                # one layer per shape: the timing runs through every live layer of it
    for m in PRODUCT_PATHS.layers():
        if m.weight.device.type == "cpu" and m.weight.dtype == dtype:
            shapes.setdefault((*m.weight.shape, m.bias is None), m)
    timed = {}
    for layer in shapes.values():
        x = torch.randn(1, layer.in_features, dtype=dtype, device="cpu")
        pairs = candidates(dtype, 0, PRODUCT_PATHS.layout_for(layer._shape_key()))
        timed[layer] = (x, time_layouts(layer._same_shape(), x, pairs))
    in_calls = {layer: all(m.in_native_layer for m in layer._same_shape()) for layer in timed}
    native_layers = (any(in_calls.values()) and native_takes(dtype, 0)
                     and all((ROW_MAJOR, NATIVE) in seconds for _, seconds in timed.values()))
    numpy_runs = dtype == torch.float32 and numpy_blas.blas_threads(threads)
    way = "torch"
    if native_layers or numpy_runs:
        # per way, per shape: the seconds of its products as a step runs them
        in_step = {"torch": {layer: min(time_layouts(layer._same_shape(), x, [min(seconds, key=seconds.get)],
                                                     OPS_BETWEEN_PRODUCTS).values())
                             for layer, (x, seconds) in timed.items()}}
        if native_layers:
            in_step["native layers"] = {
                layer: time_layouts(layer._same_shape(), x, [(ROW_MAJOR, NATIVE)],
                                    0 if in_calls[layer] else OPS_BETWEEN_PRODUCTS)[ROW_MAJOR, NATIVE]
                for layer, (x, _) in timed.items()}
        if numpy_runs:
            time.sleep(0.01)       # torch's idle workers spin a while after their last parallel region
            in_step[NUMPY] = {}
            with numpy_blas.torch_threads(1):
                for layer, (x, seconds) in timed.items():
                    layouts = dict.fromkeys(layout for layout, _ in seconds)
                    numpy = time_layouts(layer._same_shape(), x, [(layout, NUMPY) for layout in layouts],
                                         OPS_BETWEEN_PRODUCTS)
                    in_step[NUMPY][layer] = min(numpy.values())
                    seconds |= numpy
        way = min(in_step, key=lambda w: sum(in_step[w].values()))
    PRODUCT_PATHS.keep_one_row(dtype, threads, way)
    for layer, (_, seconds) in timed.items():
        if way == NUMPY:       # the layout numpy was fastest on; torch's path on it, for one-row products outside such a step
            layout = min((pair for pair in seconds if pair[1] == NUMPY), key=seconds.get)[0]
            seconds = {pair: s for pair, s in seconds.items() if pair[0] == layout}
        elif way == "native layers":
            seconds = {(ROW_MAJOR, NATIVE): seconds[ROW_MAJOR, NATIVE]}
        torch_pairs = {pair: s for pair, s in seconds.items() if pair[1] != NUMPY}
        _, path = settle(layer._same_shape(), torch_pairs)
        PRODUCT_PATHS.keep((*layer.weight.shape, dtype, 0, threads), path)
