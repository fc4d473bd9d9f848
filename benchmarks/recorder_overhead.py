"""The recorder's own cost: the same runs with the recorder on and off, interleaved.

    .venv/bin/python benchmarks/recorder_overhead.py [--model smollm2-135m] [--batch 1 8] [--repeats 5]

Overhead = wall time with the recorder / wall time without - 1, per interleaved pair (median and
bootstrap 95% CI). The target is under 2% of step time.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from ablate.arm import baseline_configs, resolve_arm
from ablate.build import EngineConfig
from ablate.experiment import run_once
from ablate.checkpoints.loader import load_model
from ablate.model.config import preset
from ablate.registry import default_registry
from ablate.stats import ratio_summary
from ablate.workload import WorkloadConfig, make_requests
from ablate import device as dev


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kv-cache", default="contiguous")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    registry = default_registry()
    device = dev.resolve("auto")
    model = load_model(preset(args.model, init="random"), device)
    arm = resolve_arm(args.kv_cache, {"kv_cache": args.kv_cache}, baseline_configs(registry), registry)
    figures = {}
    for batch in args.batch:
        wl = WorkloadConfig(num_requests=batch, prompt_len=args.prompt_len, output_len=args.output_len)
        requests = make_requests(wl, model.config.vocab_size)
        engine = EngineConfig(max_num_seqs=batch)
        run_once(arm, model, requests, engine, registry, None, record=True)    # warm-up
        ratios = []
        for r in range(args.repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            wall = {rec: run_once(arm, model, requests, engine, registry, None, record=rec).row["wall_s"]
                    for rec in order}
            ratios.append(wall[True] / wall[False])
        s = ratio_summary(np.array(ratios) - 1.0)
        figures[f"batch_{batch}"] = s
        print(f"batch {batch}: recorder overhead {s['median']:+.2%} "
              f"[{s['ci_low']:+.2%}, {s['ci_high']:+.2%}] over {args.repeats} pairs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
