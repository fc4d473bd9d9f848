"""The CPU's few-row matrix products on their own: a decode step's products, per path, and the bytes of W
each reads a second.

    .venv/bin/python benchmarks/matvec_kernel.py [--rows 1 8] [--rounds 15] [--against REV]

The 121 products of one SmolLM2-135M decode step, fp32 (per layer: qkv 960 x 576, o 576 x 576, gate-up
3072 x 576, down 576 x 1536, over 30 layers of distinct weights, then the 49152 x 576 head: 538 MB
streamed from memory, as a step streams them), at each --rows count of input rows. Interleaved round by
round on torch's threads, the paths ablate.model.linear chooses among: the native kernel
(ablate/model/native/steps.c, on row-major W), MKL (`F.linear`) on row-major W and on input-major W
(W^T contiguous, where MKL's matrix-vector product streams fastest), and at one row numpy's BLAS on
either layout (lent the cores as a one-row step lends them: torch on one thread, numpy on torch's
count, ablate/model/numpy_blas.py; left out where it cannot be lent); per path the geometric mean time of
the step's products and its 95% interval over rounds, W's bytes over that time, and the time per
product shape. --against REV adds the native kernel as it was at git revision REV (its steps.c and
vectors.h, compiled with today's flags) to the same rounds. Every path is checked against MKL first.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from ablate.analysis.stats import log_interval
from ablate.measure import cpu_load
from ablate.model import native, numpy_blas
from native_at_revision import function_at

LAYERS, VOCAB = 30, 49152
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate-up": (3072, 576), "down": (576, 1536)}


def step_weights(gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """(shape name, W (d_out, d_in) row-major) for each product of a decode step, in the step's order."""
    products = [(name, torch.randn(shape, generator=gen) * shape[1] ** -0.5)
                for _ in range(LAYERS) for name, shape in LAYER_SHAPES.items()]
    return products + [("head", torch.randn(VOCAB, 576, generator=gen) * 576 ** -0.5)]


def native_at(revision: str):
    """The fp32 matvec as it was at `revision`: (W, x) -> x W^T, called as native.matvec calls today's."""
    function = function_at(revision, "steps.c", "matvec")

    def run(w, x, threads):
        y = torch.empty(x.shape[0], w.shape[0])
        function(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), x.shape[0], w.shape[0], w.shape[1], threads)
        return y
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", metavar="REV", help="also time the native kernel as it was at this git revision")
    args = parser.parse_args()
    if native.library() is None:
        raise SystemExit(f"no native kernels here: {native.unavailable_reason()}")
    earlier = native_at(args.against) if args.against else None
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    products = step_weights(gen)
    transposed = [w.t().contiguous() for _, w in products]      # input-major: W^T (d_in, d_out) contiguous
    step_bytes = sum(w.numel() * 4 for _, w in products)
    ways = {"native": lambda i, w, x: native.matvec(w, x, None, threads),
            "MKL, row-major W": lambda i, w, x: F.linear(x, w),
            "MKL, input-major W": lambda i, w, x: F.linear(x, transposed[i].t())}
    if earlier is not None:
        ways[f"native at {args.against}"] = lambda i, w, x: earlier(w, x, threads)
    lent = numpy_blas.blas_threads(threads)
    arrays = {"row-major": [w.numpy().T for _, w in products], "input-major": [w.numpy() for w in transposed]}
    one_row_ways = {f"numpy, {layout} W": (lambda i, w, x, a=a: torch.from_numpy(x.numpy() @ a[i]))
                    for layout, a in arrays.items()} if lent else {}
    print(f"{threads} threads; {len(products)} products, {step_bytes / 1e6:.0f} MB of fp32 W a step")
    print("| rows | path | ms per step [95% CI] | W GB/s | vs MKL row-major | " + " | ".join(
        f"{name} ms" for name in (*LAYER_SHAPES, "head")) + " | CPU left to it |")
    print("|---|---|---|---|---|" + "---|" * (len(LAYER_SHAPES) + 1) + "---|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for _, w in products}
            ways_here = ways | (one_row_ways if rows == 1 else {})
            for name, way in ways_here.items():
                for i in (0, 1, 2, 3, len(products) - 1):
                    w = products[i][1]
                    torch.testing.assert_close(way(i, w, inputs[w.shape[1]]), F.linear(inputs[w.shape[1]], w),
                                               atol=1e-4, rtol=1e-4, msg=lambda why, n=name: f"{n} against MKL: {why}")
            times = {name: [] for name in ways_here}
            per_shape = {name: {shape: 0.0 for shape in (*LAYER_SHAPES, "head")} for name in ways_here}
            with cpu_load.CpuShareMeter(threads) as meter:
                for _ in range(args.rounds):
                    for name, way in ways_here.items():
                        with numpy_blas.torch_threads(1) if name in one_row_ways else contextlib.nullcontext():
                            step = time.perf_counter()
                            for i, (shape, w) in enumerate(products):
                                start = time.perf_counter()
                                way(i, w, inputs[w.shape[1]])
                                per_shape[name][shape] += time.perf_counter() - start
                            times[name].append(time.perf_counter() - step)
            share = f"{meter.share.cpu_left_share:.2f}" if meter.share else "not read"
            mkl = log_interval(times["MKL, row-major W"]).center
            for name, seconds in times.items():
                spread = log_interval(seconds)
                shapes = " | ".join(f"{per_shape[name][shape] / args.rounds * 1e3:.2f}" for shape in per_shape[name])
                print(f"| {rows} | {name} | {spread.center * 1e3:.1f} [{spread.low * 1e3:.1f}, {spread.high * 1e3:.1f}] | "
                      f"{step_bytes / spread.center / 1e9:.1f} | {mkl / spread.center:.2f}x | {shapes} | {share} |")


if __name__ == "__main__":
    main()
