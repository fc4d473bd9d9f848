"""Host time per decode step, for every built-in arm whose device work can be stood in for.

    python benchmarks/host_overhead.py [--batches 1 16 64] [--model smollm2-135m] [--before REV] [--out DIR]

The model's forward pass (every layer: products, attention, K/V writes) is replaced by a stand-in
that returns ready-made logits at once, so what is left of a step is the host's part: the
scheduler, the engine's contract checks, the KV cache's plan, the runner's packed inputs, sampling,
the commit and the recorder. On a GPU that is the time the device idles between steps unless the
host runs ahead of it; on the CPU it is measured alone. Each arm serves `batch` requests at once
(16 prompt tokens, 64 output tokens) twice, and the second run's decode steps are reported:
median and p90 of the whole step (the scheduler's choice through the step's hooks) and the median
of each part. The stand-in's logits rotate over a bank of random rows so that tokens vary.

Arms whose drafter runs a model (early exit, layer skip) are left out: their drafts are device
work the stand-in does not replace. --before REV runs REV's tree (a git worktree) and this one, one
after the other per batch size, each in a process of its own, and gives each arm's ratio of median
steps with a bootstrap 95% interval over the steps.
"""
from __future__ import annotations

try:
    from ablate import process_env
    process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)
except ImportError:         # --before a tree older than process_env.py, whose `import ablate` set them
    pass

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.measure.recorder import Recorder
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.testing.syncs import BUILT_IN_ARMS

REPO = Path(__file__).resolve().parents[1]
PROMPT, OUTPUT = 16, 64
MODEL_DRAFTERS = ("early_exit", "layer_skip")
# part -> the (object attribute, method) pairs whose time it is; runner.forward's own share is what
# is left of it after its parts, sampling what is left of decoding.step after runner.forward
PARTS = ("scheduler", "checks", "cache_plan", "runner_inputs", "forward_rest", "sampling", "commit", "recorder")


class StepTimer:
    """Wraps methods of one built arm with timers; collects the time of each part per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner, method: str, part: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter_ns() - t0
        setattr(owner, method, timed)


def stand_in(vocab: int, max_rows: int):
    """A forward pass that costs nothing: step -> (N, V) logits, rotating over a bank of random rows."""
    bank = torch.randn(max_rows + 61, vocab, generator=torch.Generator().manual_seed(0))   # (R, V)
    calls = [0]

    def logits(step) -> torch.Tensor:
        calls[0] = (calls[0] + 1) % 61
        n = step.logits_indices.numel()
        return bank[calls[0]:calls[0] + n]                                                  # (N, V)
    return logits


def requests(batch: int, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(batch)
    return [Request(i, tuple(torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()), OUTPUT,
                    SamplingParams(), ()) for i in range(batch)]


def measure(name: str, spec: dict, model: LlamaModel, batch: int, registry) -> list[dict[str, float]]:
    """The host's part of each decode step of the arm's second run, in microseconds."""
    arm = resolve_arm(name, spec, baseline_configs(registry), registry)
    engine_cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(4096, batch * PROMPT))
    steps = []
    for run in range(2):
        recorders = []
        built = build_arm(arm, model, engine_cfg, PROMPT + OUTPUT, registry,
                          lambda kv: recorders.append(Recorder(kv)) or recorders)
        engine, runner = built.engine, built.engine.runner
        runner._logits = stand_in(model.config.vocab_size, batch * 8)
        timer = StepTimer()
        for method in ("next_batch", "finish_step", "add"):
            timer.wrap(engine.scheduler, method, "scheduler")
        timer.wrap(engine, "checked", "checks")
        timer.wrap(engine, "commit", "commit")
        timer.wrap(runner.kv_cache, "begin_step", "cache_plan")
        timer.wrap(runner, "inputs", "runner_inputs")
        timer.wrap(runner, "forward", "forward")
        timer.wrap(runner, "_logits", "stand_in")
        timer.wrap(engine.decoding, "step", "decoding")
        for method in ("on_step_start", "on_step_end", "on_finish"):
            timer.wrap(recorders[0], method, "recorder")
        step = engine.step

        def timed_step(b, step=step, timer=timer):
            decode = all(s.num_computed_tokens >= s.num_prompt_tokens for s in b.seqs)
            t0 = time.perf_counter_ns()
            out = step(b)
            total = time.perf_counter_ns() - t0 + timer.current.pop("scheduler_before", 0.0)
            parts = dict(timer.current)
            timer.current = defaultdict(float)
            if decode:
                timer.steps.append({"total": total + parts.get("scheduler", 0.0), **parts})
            return out
        engine.step = timed_step
        next_batch = engine.scheduler.next_batch

        def timed_next_batch(next_batch=next_batch, timer=timer):
            t0 = time.perf_counter_ns()     # the choice of this step's batch counts toward the step
            out = next_batch()
            timer.current["scheduler_before"] = time.perf_counter_ns() - t0
            return out
        engine.scheduler.next_batch = timed_next_batch
        try:
            engine.run(requests(batch, model.config.vocab_size))
        finally:
            built.close()
        steps = timer.steps
    out = []
    for s in steps:
        forward = s.get("forward", 0.0)
        row = {"total": s["total"], "scheduler": s.get("scheduler", 0.0),
               "checks": s.get("checks", 0.0), "cache_plan": s.get("cache_plan", 0.0),
               "runner_inputs": s.get("runner_inputs", 0.0),
               "forward_rest": forward - s.get("cache_plan", 0.0) - s.get("runner_inputs", 0.0) - s.get("stand_in", 0.0),
               "sampling": s.get("decoding", 0.0) - forward, "commit": s.get("commit", 0.0),
               "recorder": s.get("recorder", 0.0)}
        out.append({k: v / 1e3 for k, v in row.items()})      # ns -> us
    return out


def measure_all(batches: list[int], model_name: str, only: list[str] | None) -> list[dict]:
    """One row per (batch, arm): the host's time per decode step (median, p90, each part's median) and
    the steps' totals (us)."""
    torch.manual_seed(0)
    registry, model = default_registry(), LlamaModel.random(preset(model_name))
    arms = {n: s for n, (s, _) in BUILT_IN_ARMS.items()
            if not any(d in str(s) for d in MODEL_DRAFTERS) and (not only or n in only)}
    rows = []
    for batch in batches:
        for name, spec in arms.items():
            steps = pd.DataFrame(measure(name, spec, model, batch, registry))
            row = {"arm": name, "batch": batch, "decode_steps": len(steps),
                   "host_us_p50": float(np.median(steps["total"])), "host_us_p90": float(np.quantile(steps["total"], 0.9))}
            row |= {f"{p}_us": float(steps[p].median()) for p in PARTS}
            rows.append(row | {"totals_us": steps["total"].tolist()})
            print(f"batch {batch:>3} {name:<24} {row['host_us_p50']:8.1f} us (p90 {row['host_us_p90']:.1f})", flush=True)
    return rows


def median_ratio(before: list[float], after: list[float], seed: int = 0) -> tuple[float, float, float]:
    """median(before) / median(after) and its 95% percentile-bootstrap interval over the steps."""
    gen = np.random.default_rng(seed)
    b, a = np.asarray(before), np.asarray(after)
    draws = [np.median(gen.choice(b, b.size)) / np.median(gen.choice(a, a.size)) for _ in range(2000)]
    return float(np.median(b) / np.median(a)), *np.quantile(draws, [0.025, 0.975]).tolist()


def run_side(where: Path, batch: int, args, env: dict) -> list[dict]:
    """This script, at `where` (a checkout), for one batch size, in a process of its own."""
    out = Path(tempfile.mkdtemp()) / "rows.json"
    cmd = [sys.executable, str(where / "benchmarks" / "host_overhead.py"), "--batches", str(batch),
           "--model", args.model, "--json", str(out), *(["--arms", *args.arms] if args.arms else [])]
    subprocess.run(cmd, cwd=where, env={**os.environ, **env}, check=True)
    return json.loads(out.read_text())


def before_and_after(args) -> pd.DataFrame:
    """Each batch size at REV and in this tree, one after the other (REV's ablate and plugins on PYTHONPATH
    from a worktree; this script copied into it), and the ratio of each arm's median step."""
    work = Path(tempfile.mkdtemp())
    tree = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before], cwd=REPO, check=True,
                   capture_output=True)
    try:
        shutil.copy(Path(__file__), tree / "benchmarks" / "host_overhead.py")
        paths = [tree, *sorted((tree / "plugins").glob("*")), tree / "kernels"]
        rows = []
        for batch in args.batches:
            before = run_side(tree, batch, args, {"PYTHONPATH": os.pathsep.join(map(str, paths))})
            after = run_side(REPO, batch, args, {})
            for b, a in zip(before, after):
                ratio, low, high = median_ratio(b["totals_us"], a["totals_us"])
                rows.append({"arm": a["arm"], "batch": batch, "before_us_p50": b["host_us_p50"],
                             "after_us_p50": a["host_us_p50"], "after_us_p90": a["host_us_p90"],
                             "faster": ratio, "ci_low": low, "ci_high": high,
                             **{f"{p}_us": a[f"{p}_us"] for p in PARTS}})
        return pd.DataFrame(rows)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--model", default="smollm2-135m", help="a preset: its vocabulary and cache shapes")
    parser.add_argument("--arms", nargs="*", help="a subset of the built-in arms (ablate/testing/syncs.py)")
    parser.add_argument("--before", help="a git revision: its host time beside this tree's, batch by batch")
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)     # run_side's rows
    parser.add_argument("--out", type=Path, help="write host_overhead.csv and .md here")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
    if args.json:
        args.json.write_text(json.dumps(measure_all(args.batches, args.model, args.arms)))
        return
    if args.before:
        table = before_and_after(args)
    else:
        table = pd.DataFrame(measure_all(args.batches, args.model, args.arms)).drop(columns="totals_us")
    md = table.to_markdown(index=False, floatfmt=".2f")
    print(md)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "host_overhead.csv", index=False)
        (args.out / "host_overhead.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
