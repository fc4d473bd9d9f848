"""Speculative decoding's verify pass over k + 1 tokens against a one-token decode step, k = 1..16.

    .venv/bin/python benchmarks/verify_cost.py --out results/verify_cost          # SmolLM2-135M shape, fp32
    .venv/bin/python benchmarks/verify_cost.py --model tiny --max-k 4 --rounds 3 --out /tmp/verify-smoke

The speedup formula of speculative decoding assumes the target checks k drafts for about the price
of one step. Per k this prints the measured ratio verify time / step time (geometric mean over
rounds, 95% t-interval), the roofline's prediction from this machine's peaks and the pass's bound,
and the knee: the largest k whose ratio stays within --tolerance of one step at every k up to it
(ablate/measure/verify_cost.py has the definitions). Random weights: the time does not depend on
their values. Writes verify_cost.csv and verify_cost.png (ratio vs k, its interval as a band, the
prediction dashed) under --out. On a GPU the passes are timed after a device synchronisation.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from ablate.checkpoints.loader import load_model
from ablate.measure import device as dev
from ablate.measure.verify_cost import KNEE_TOLERANCE, knee, verify_cost
from ablate.model.presets import preset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset (random weights)")
    p.add_argument("--init", default="random", choices=["random", "pretrained"])
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 | auto")
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    p.add_argument("--max-k", type=int, default=16, help="draft lengths k = 1 .. max-k")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every k (an interval needs 3)")
    p.add_argument("--passes", type=int, default=3, help="passes of each kind per k and round (their median)")
    p.add_argument("--tolerance", type=float, default=KNEE_TOLERANCE, help="the knee's ratio limit")
    p.add_argument("--kv-cache", default="contiguous")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    p.add_argument("--no-peaks", action="store_true", help="no roofline prediction (peaks are not measured)")
    p.add_argument("--out", required=True, help="folder for verify_cost.csv, verify_cost.png and verify_cost.json")
    return p.parse_args()


def plot(frame: pd.DataFrame, path: Path, tolerance: float, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(frame["k"], frame["ratio"], marker="o", label="measured (geometric mean)")
    ax.fill_between(frame["k"], frame["ratio_ci_low"], frame["ratio_ci_high"], alpha=0.25, label="95% CI")
    if frame["predicted_ratio"].notna().any():
        ax.plot(frame["k"], frame["predicted_ratio"], linestyle="--", label="roofline prediction")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(tolerance, color="grey", linewidth=0.8, linestyle=":", label=f"{tolerance:g}x a step")
    ax.set_xlabel("draft tokens k (the pass feeds k + 1)")
    ax.set_ylabel("verify pass time / one-token step time")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    args = parse_args()
    if args.max_k < 1:
        raise SystemExit(f"--max-k must be >= 1, got {args.max_k}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = dev.resolve(args.device)
    cfg = preset(args.model, init=args.init, dtype=args.dtype,
                 max_seq_len=max(args.context + args.max_k + 1, 1))
    model = load_model(cfg, device)
    start = time.perf_counter()
    frame = verify_cost(model, context=args.context, ks=range(1, args.max_k + 1), rounds=args.rounds,
                        passes_per_round=args.passes, kv_cache=args.kv_cache, attention=args.attention,
                        peaks=None if args.no_peaks else "auto")
    seconds = time.perf_counter() - start
    measured, predicted = knee(frame, args.tolerance), knee(frame, args.tolerance, "predicted_ratio")
    shown = frame.drop(columns=["context"]).round(3)
    print(shown.to_string(index=False))
    where = (f"{args.model} ({model.config.dtype}, {device}, {torch.get_num_threads()} threads), "
             f"context {args.context}, {args.rounds} rounds x {args.passes} passes, {seconds:.0f} s")
    print(f"\n{where}\nknee (ratio <= {args.tolerance:g} up to k): measured k = {measured}, "
          f"roofline k = {predicted if frame['predicted_ratio'].notna().any() else 'n/a (no peaks)'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "verify_cost.csv", index=False)
    (out / "verify_cost.json").write_text(json.dumps(
        {"args": vars(args), "device": dev.describe(device), "seconds": seconds, "knee": measured,
         "predicted_knee": predicted}, indent=2, default=str))
    image = plot(frame, out / "verify_cost.png", args.tolerance, where)
    print(f"written: {out / 'verify_cost.csv'}, {image}")


if __name__ == "__main__":
    main()
