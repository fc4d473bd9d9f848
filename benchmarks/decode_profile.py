"""What ablate's decode step spends its time on: matrix products, attention, norms and the rest.

    .venv/bin/python benchmarks/decode_profile.py [--batch 1] [--kv contiguous] [--attention sdpa] [--steps 64]
                                                  [--rounds 3] [--out DIR]

SmolLM2-135M-Instruct fp32 (SDPA over a contiguous KV cache, or over a paged one's blocks gathered
per step: --kv paged; or, with --kv paged --attention paged, the paged-decode kernel reading the
blocks in place, as the engines_serving experiment runs), 128-token prompts, greedy. The CPU
products run several ways, interleaved round by round in one process: `timed` (the paths
ablate.model.linear times at run time: what every run uses), `no native` (the same, timed and run
without ablate's native kernels, ablate/model/native/: its products and its RMSNorm), `mkl` and
`onednn` (every product of up to 16 rows forced onto one of torch's paths), and at batch 1 `numpy`
(every one-token step lent to numpy's BLAS, ablate/model/numpy_blas.py), `native` (every one-row
product on the native kernel, each layer's dense arithmetic in two native calls around the cache and
the attention, or, with --attention paged, a decode step's layer after the first in one call with its
cache's write and the attention inside: ablate/model/native/layers.py), `native, two calls` (never
in one) and `native, op by op` (the same kernels called one by one from Python, as before the layer
calls); past 16 rows only `timed` (the native kernels take at most 16). Per way: the decode step's
median time from the engine's recorder, and a torch.profiler
breakdown of the same steps run again, each category's share of the profiled step applied to the
unprofiled one: the products (mkldnn::_linear_pointwise, aten::mm/addmm, numpy's matmul, the native
matvec), the layers' native calls (their products, norms, RoPE and SwiGLU; the one-call layers apart,
with their cache writes and attention), the attention and
KV-cache slots (the plugins' whole calls), RMSNorm (aten::rms_norm and the operations it is made of,
or the native kernel) and the rest; beside it the weights' bytes per step over the step time against
the machine's read bandwidth (a 1 GiB buffer, measured here), and the products' arithmetic rate (2
flops per weight per row; none where the layer calls hold the products).
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # first, before torch and numpy load, as the CLI does: huge pages, numpy's spinning bounded

import argparse
import contextlib
import unittest.mock
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.measure.device import measure_read_bandwidth
from ablate.measure.recorder import Recorder, StepHook
from ablate.model import native, numpy_blas
from ablate.model.presets import preset
from ablate.model.forward import Forward
from ablate.model.native_plan import NativePlans, two_calls_only
from ablate.model.native.layers import LayerCalls
from ablate.model.linear import Linear
from ablate.model.product_paths import PRODUCT_PATHS

# category -> the profiler events it sums (their total time: RMSNorm is made of several operations;
# the attention and KV-cache slots are named around their plugins' calls, gathers from blocks included)
CATEGORIES = {"products": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "numpy_blas::matmul",
                           "native::matvec"),
              "attention": ("slot::attention",),
              "kv_cache": ("slot::kv_cache",),
              "layer_calls": ("native::layer_qkv", "native::layer_out_mlp"),
              "one_call_layers": ("native::layer_paged_decode",),
              "rms_norm": ("aten::rms_norm", "native::rms_norm")}
OP_BY_OP = "native, op by op"    # the native way with each layer's kernels called one by one from Python
TWO_CALLS = "native, two calls"  # the native way with no decode step's layer in one call (the slots between two)


def force(way: str, chosen: dict) -> None:
    """Every 1-row (decode at batch 1) or 2-16-row product onto `way` (numpy and the native kernel:
    1-row products only; the rest keep the timed choices), or back to the choices timed with (`timed`)
    or without (`no native`) the native kernels."""
    PRODUCT_PATHS.restore(chosen["no native" if way == "no native" else "timed"])
    if way in ("mkl", "onednn"):
        PRODUCT_PATHS.force({"1": way, "2-16": way})
    elif way in ("numpy", "native", OP_BY_OP, TWO_CALLS):
        PRODUCT_PATHS.force({"1": "native" if way in (OP_BY_OP, TWO_CALLS) else way})


def layers_as_calls(way: str):
    """The layers as native calls where they can run so (ablate/model/native_plan.py: a decode step's
    layer in one call where its cache and attention allow, else two around the slots); for TWO_CALLS
    never in one; for OP_BY_OP op by op from Python."""
    if way == OP_BY_OP:
        return unittest.mock.patch.object(NativePlans, "for_step", lambda self, layers, x, fwd: None)
    if way == TWO_CALLS:
        return two_calls_only()
    return contextlib.nullcontext()


def native_kernels(on: bool):
    """ablate's native kernels (products and RMSNorm) on, or off as where they cannot be built."""
    return contextlib.nullcontext() if on else PRODUCT_PATHS.without_native("off for this way")


def named(method, event: str):
    """`method` as a profiler event of its own: numpy's matmul (not a torch operation), a slot's call."""
    def run(*args):
        with record_function(event):
            return method(*args)
    return run


class DecodeProfile(StepHook):
    """torch.profiler over the decode steps only: from the first step without a prompt in it to the
    end of the run (a 64-request prefill would swamp a few decode steps)."""

    def __init__(self) -> None:
        self.prof = profile(activities=[ProfilerActivity.CPU])
        self.started = False

    def on_step_start(self, batch, at: float) -> None:
        prompt = any(s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs)
        if not self.started and not prompt:
            self.prof.start()
            self.started = True


def decode_steps(model, arm, registry, batch: int, steps: int, profiled: bool):
    recorders, profiler = [], DecodeProfile()
    engine = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(4096, 128 * batch))   # one prefill step
    built = build_arm(arm, model, engine, 128 + steps + 8, registry,
                      lambda kv: [recorders.append(Recorder(kv)) or recorders[-1]] + ([profiler] if profiled else []))
    requests = [Request(i, tuple(range(100 + i, 228 + i)), steps) for i in range(batch)]
    try:
        built.engine.run(requests)
    finally:
        if profiler.started:
            profiler.prof.stop()
        built.close()
    decode = [s.end - s.start for s in recorders[0].steps if s.num_prefill_seqs == 0]
    return float(np.median(decode)) * 1e3, len(decode), profiler.prof if profiled else None


def breakdown(prof, num_steps: int, profiled_ms: float, step_ms: float) -> dict[str, float]:
    """ms per decode step by category: each category's share of the profiled step (the profiler slows
    what it records) applied to the unprofiled step time; the rest is what no category holds."""
    totals = {name: 0.0 for name in CATEGORIES}
    for event in prof.key_averages():
        for name, ops in CATEGORIES.items():
            if event.key in ops:
                totals[name] += event.cpu_time_total / 1e3 / num_steps
    scaled = {f"{k}_ms": v * step_ms / profiled_ms for k, v in totals.items()}
    return scaled | {"rest_ms": step_ms - sum(scaled.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv", choices=("contiguous", "paged"), default="contiguous",
                        help="the KV cache (paged: its blocks gathered for SDPA, as engines_serving runs)")
    parser.add_argument("--attention", choices=("sdpa", "paged"), default="sdpa",
                        help="paged (with --kv paged): decode attention reading the blocks in place")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    registry = default_registry()
    model = load_model(preset("smollm2-135m", init="pretrained"))
    arm = resolve_arm("profile", {"kv_cache": args.kv, "attention": args.attention}, baseline_configs(registry),
                      registry)
    chosen = {}
    for way in ("no native", "timed"):          # warm-ups: the timed choices are made, without and with
        PRODUCT_PATHS.reset()                     # the native kernels
        with native_kernels(way == "timed"):
            decode_steps(model, arm, registry, args.batch, 8, profiled=False)
        chosen[way] = PRODUCT_PATHS.snapshot()
    Linear._numpy = named(Linear._numpy, "numpy_blas::matmul")
    native.matvec, native.rms_norm = named(native.matvec, "native::matvec"), named(native.rms_norm, "native::rms_norm")
    LayerCalls.qkv = named(LayerCalls.qkv, "native::layer_qkv")
    LayerCalls.out_mlp = named(LayerCalls.out_mlp, "native::layer_out_mlp")
    LayerCalls.paged_decode = named(LayerCalls.paged_decode, "native::layer_paged_decode")
    Forward.attend, Forward.store = named(Forward.attend, "slot::attention"), named(Forward.store, "slot::kv_cache")
    bandwidth = measure_read_bandwidth() / 1e9
    # past 16 rows a step's products keep their timed paths whatever the way: one way to run
    numpy = args.batch == 1 and numpy_blas.blas_threads(torch.get_num_threads())
    ways = ("timed",) if args.batch > 16 else (("timed", "no native", "mkl", "onednn") + (("numpy",) if numpy else ())
                                               + (("native", OP_BY_OP) if args.batch == 1 and native.available() else ())
                                               + ((TWO_CALLS,) if args.batch == 1 and native.available()
                                                  and args.attention == "paged" else ()))
    rows = []
    for round_ in range(args.rounds):
        for way in ways if round_ % 2 == 0 else ways[::-1]:
            force(way, chosen)
            with native_kernels(way != "no native"), layers_as_calls(way):
                step_ms, n, _ = decode_steps(model, arm, registry, args.batch, args.steps, profiled=False)
                profiled_ms, n, prof = decode_steps(model, arm, registry, args.batch, args.steps, profiled=True)
            rows.append({"way": way, "round": round_, "step_ms": step_ms} | breakdown(prof, n, profiled_ms, step_ms))
    force("no native", chosen)
    with native_kernels(False):
        print(f"choices without the native kernels: {PRODUCT_PATHS.choices()}")
    force("timed", chosen)
    table = pd.DataFrame(rows).groupby("way").median(numeric_only=True).drop(columns="round")
    table["weights_gb_s"] = model.weight_bytes() / table["step_ms"] / 1e6
    table["of_read_bandwidth"] = table["weights_gb_s"] / bandwidth
    # 2 flops per weight per row (the embedding table counted once, as the tied LM head)
    table["products_gflop_s"] = (2 * args.batch * model.weight_bytes() / 4 / table["products_ms"] / 1e6).where(
        (table["layer_calls_ms"] == 0) & (table["one_call_layers_ms"] == 0))
    print(f"read bandwidth {bandwidth:.1f} GB/s (1 GiB buffer); {torch.get_num_threads()} threads; batch {args.batch}; "
          f"timed choices: {PRODUCT_PATHS.choices()}")
    print(table.to_markdown(floatfmt=".3g"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"decode_profile_b{args.batch}" + ("_paged" if args.kv == "paged" else "") + (
            "_paged_attention" if args.attention == "paged" else "")
        table.assign(read_bandwidth_gb_s=bandwidth).to_csv(args.out / f"{name}.csv")


if __name__ == "__main__":
    main()
