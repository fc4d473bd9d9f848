"""What ablate's decode step spends its time on: matrix products, attention, norms and the rest.

    .venv/bin/python benchmarks/decode_profile.py [--batch 1] [--steps 64] [--rounds 3] [--out DIR]

SmolLM2-135M-Instruct fp32 (contiguous KV cache, SDPA), 128-token prompts, greedy. The CPU products
run three ways, interleaved round by round in one process: `timed` (the path ablate.model.linear times
at run time over every layer of a shape: what every run uses), `mkl` and `onednn` (every product of a
decode step forced onto one path). Per way: the decode step's median time from the engine's recorder,
and a torch.profiler breakdown of the same steps (self CPU time per step of the products
(mkldnn::_linear_pointwise, aten::mm/addmm), of attention (scaled_dot_product_*), of RMSNorm, and the
rest), beside the weights' bytes per step over the step time against the machine's read bandwidth
(a 1 GiB buffer, measured here).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.measure.device import measure_read_bandwidth
from ablate.measure.recorder import Recorder
from ablate.model import linear
from ablate.model.config import preset

CATEGORIES = {"products": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"),
              "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
              "rms_norm": ("aten::rms_norm",)}


def force(way: str, chosen: dict) -> None:
    """Every 1-row (decode at batch 1) or 2-16-row product onto `way`, or back to the timed choice."""
    linear._paths.clear()
    linear._paths.update(chosen if way == "timed" else {k: (way if k[3] < 2 else v) for k, v in chosen.items()})


def decode_steps(model, arm, registry, batch: int, steps: int, profiled: bool):
    recorders = []
    built = build_arm(arm, model, EngineConfig(max_num_seqs=batch), 128 + steps + 8, registry,
                      lambda kv: recorders.append(Recorder(kv)) or recorders)
    requests = [Request(i, tuple(range(100 + i, 228 + i)), steps) for i in range(batch)]
    try:
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                built.engine.run(requests)
        else:
            prof = None
            built.engine.run(requests)
    finally:
        built.close()
    decode = [s.end - s.start for s in recorders[0].steps if s.num_prefill_seqs == 0]
    return float(np.median(decode)) * 1e3, len(decode), prof


def breakdown(prof, num_steps: int, step_ms: float) -> dict[str, float]:
    """Self CPU ms per decode step by category (the prefill step's share is small beside 63 decode steps)."""
    totals = {name: 0.0 for name in CATEGORIES}
    for event in prof.key_averages():
        for name, ops in CATEGORIES.items():
            if event.key in ops:
                totals[name] += event.self_cpu_time_total / 1e3 / (num_steps + 1)
    return {f"{k}_ms": v for k, v in totals.items()} | {"rest_ms": step_ms - sum(totals.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    registry = default_registry()
    model = load_model(preset("smollm2-135m", init="pretrained"))
    arm = resolve_arm("profile", {"kv_cache": "contiguous", "attention": "sdpa"}, baseline_configs(registry), registry)
    decode_steps(model, arm, registry, args.batch, 8, profiled=False)       # warm-up: the timed choices are made
    chosen = dict(linear._paths)
    bandwidth = measure_read_bandwidth() / 1e9
    rows = []
    for round_ in range(args.rounds):
        for way in ("timed", "mkl", "onednn") if round_ % 2 == 0 else ("onednn", "mkl", "timed"):
            force(way, chosen)
            step_ms, n, _ = decode_steps(model, arm, registry, args.batch, args.steps, profiled=False)
            _, _, prof = decode_steps(model, arm, registry, args.batch, args.steps, profiled=True)
            rows.append({"way": way, "round": round_, "step_ms": step_ms} | breakdown(prof, n, step_ms))
    force("timed", chosen)
    table = pd.DataFrame(rows).groupby("way").median(numeric_only=True).drop(columns="round")
    table["weights_gb_s"] = model.weight_bytes() / table["step_ms"] / 1e6
    table["of_read_bandwidth"] = table["weights_gb_s"] / bandwidth
    print(f"read bandwidth {bandwidth:.1f} GB/s (1 GiB buffer); {torch.get_num_threads()} threads; batch {args.batch}; "
          f"timed choices: {linear.linear_paths()}")
    print(table.to_markdown(floatfmt=".3g"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.assign(read_bandwidth_gb_s=bandwidth).to_csv(args.out / f"decode_profile_b{args.batch}.csv")


if __name__ == "__main__":
    main()
