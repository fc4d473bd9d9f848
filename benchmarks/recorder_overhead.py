"""The recorder's own cost, measured two ways in one run.

    .venv/bin/python benchmarks/recorder_overhead.py [--model smollm2-135m] [--batch 1 8] [--repeats 5]

1. Directly: the time spent inside the recorder's hooks (every call timed), as a share of the
   run's wall time: precise, since it does not difference two noisy runs.
2. End to end: wall time with the recorder / wall time without - 1, per interleaved pair (median
   and bootstrap 95% CI): what a user sees, but on a shared machine its CI is wide.
The target is under 2% of step time.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import time

import numpy as np

from ablate.analysis.analytic import CostModel
from ablate.analysis.stats import log_interval
from ablate.api.context import EngineConfig
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.hooks import StepHook
from ablate.engine.registry import default_registry
from ablate.experiment.run import run_once
from ablate.measure import device as dev
from ablate.measure.recorder import Recorder
from ablate.model.presets import preset
from ablate.workload.requests import WorkloadConfig, make_requests


class TimedHooks(StepHook):
    """Forwards every hook to the recorder and adds up the time spent in it."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner
        self.seconds = 0.0

    def _call(self, name, *args) -> None:
        start = time.perf_counter()
        getattr(self.inner, name)(*args)
        self.seconds += time.perf_counter() - start

    def on_arrival(self, *a): self._call("on_arrival", *a)
    def on_step_start(self, *a): self._call("on_step_start", *a)
    def on_step_end(self, *a): self._call("on_step_end", *a)
    def on_finish(self, *a): self._call("on_finish", *a)


def hook_share(arm, model, requests, engine, registry, max_seq_len) -> float:
    """Seconds inside the recorder's hooks / wall seconds of the whole run."""
    timed: list[TimedHooks] = []

    def hooks(kv_cache):
        timed.append(TimedHooks(Recorder(kv_cache, CostModel(model.config, kv_cache.keeps_kv))))
        return timed

    built = build_arm(arm, model, engine, max_seq_len, registry, hooks)
    start = time.perf_counter()
    built.engine.run(requests)
    return timed[0].seconds / (time.perf_counter() - start)


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
        s = log_interval(np.array(ratios))     # on/off time ratio: its geometric mean and t CI
        max_len = args.prompt_len + args.output_len
        shares = [hook_share(arm, model, requests, engine, registry, max_len) for _ in range(args.repeats)]
        figures[f"batch_{batch}"] = {"end_to_end": [s.center - 1, s.low - 1, s.high - 1], "hook_share_median": float(np.median(shares)),
                                     "hook_share_max": float(np.max(shares))}
        print(f"batch {batch}: time inside the recorder's hooks {np.median(shares):.3%} of the run "
              f"(max {np.max(shares):.3%} over {args.repeats} runs); end to end on/off "
              f"{s.center - 1:+.2%} [{s.low - 1:+.2%}, {s.high - 1:+.2%}] over {args.repeats} pairs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
