"""Speculative decoding on SmolLM2-135M-Instruct (pretrained), CPU, greedy, prompts that quote their input.

    .venv/bin/python benchmarks/speculative.py --out results/speculative.json            # full size
    .venv/bin/python benchmarks/speculative.py --num-prompts 1 --output-len 16 --repeats 1 \\
        --ks 2 --out /tmp/speculative-smoke.json                                           # a quick check

Autoregressive decoding and speculative decoding with every drafter at every k run the same requests,
interleaved (A B C ..., then ... C B A) so that drift of a shared machine falls on every arm alike.
Per arm:
  speedup          autoregressive time / arm time per round (median): tokens/s including prefill
  decode speedup   autoregressive TPOT / arm TPOT: the decode phase only, what the formula predicts
  alpha, acceptance rate, tokens per target pass, acceptance by draft position (decoding.* stats)
  predicted        (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)) from the measured alpha and cost ratio c
The measured decode speedup factors as  tokens per pass / (speculative step time / autoregressive step
time), the prediction as  E[tokens per pass | alpha, k] / (k c + 1). Where the two differ by more than
25% the report says which factor is off and why: acceptance that is not independent across positions
(the acceptance by position is printed), fewer than k drafts per step, a verify pass over k+1 tokens
that costs more than one autoregressive step, or per-step overhead outside the two passes.
The target: n-gram drafting at its best k at least 1.5x the tokens/s of autoregressive decoding.
Requests stop at the model's EOS token (--ignore-eos: always output-len tokens) and are served one at a
time. On a CPU, try --threads 1 and 2: a pass over k+1 tokens runs matrix-matrix products where a
1-token pass runs matrix-vector ones, and their cost (and OpenMP's, on a busy machine) differs.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import Arm, baseline_configs, resolve_arm
from ablate.engine.registry import Registry, default_registry
from ablate.experiment.run import run_once
from ablate.measure import device as dev
from ablate.model.presets import preset
from ablate.results import environment
from ablate_decoding.spec_stats import expected_tokens_per_pass

NGRAM_TARGET = 1.5        # n-gram at its best k vs autoregressive tokens/s
DISAGREEMENT = 0.25       # |measured / predicted - 1| above this gets an explanation


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="target model preset")
    p.add_argument("--init", default="pretrained", choices=["pretrained", "random"])
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompt-kind", default="quote", choices=["quote", "open"])
    p.add_argument("--num-prompts", type=int, default=4, help="requests, served one at a time")
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per request of the warm-up round")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate output-len tokens past the end of the answer (default: stop at the EOS token)")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--drafters", nargs="+", default=["ngram", "early_exit", "layer_skip", "draft_model"])
    p.add_argument("--ngram-n", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--exit-layer", type=int, default=10)
    p.add_argument("--skip-every", type=int, default=2)
    p.add_argument("--draft-model", default="smollm2-135m", help="preset or checkpoint path (same vocabulary)")
    p.add_argument("--draft-overrides", default="{}", help="JSON model fields for the draft, e.g. '{\"seed\": 1}'")
    p.add_argument("--kv-cache", default="contiguous")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="write the figures as JSON here")
    return p.parse_args()


def drafter_options(args: argparse.Namespace, drafter: str) -> dict[str, Any]:
    return {"ngram": {"ngram_n": args.ngram_n, "ngram_min": args.ngram_min}, "early_exit": {"exit_layer": args.exit_layer},
            "layer_skip": {"skip_every": args.skip_every},
            "draft_model": {"draft_model": args.draft_model, "draft_overrides": json.loads(args.draft_overrides)},
            }[drafter]


def make_arms(args: argparse.Namespace, registry: Registry) -> list[Arm]:
    base = resolve_arm("autoregressive", {"kv_cache": args.kv_cache, "attention": args.attention},
                       baseline_configs(registry), registry)
    arms = [base]
    for drafter in args.drafters:
        for k in args.ks:
            spec = {"decoding": {"name": "speculative", "drafter": drafter, "k": k,
                                 "seed": args.seed, **drafter_options(args, drafter)}}
            arms.append(resolve_arm(f"{drafter}_k{k}", spec, base.plugins, registry))
    return arms


def make_requests(args: argparse.Namespace, model) -> list[Request]:
    from ablate.checkpoints.loader import load_tokenizer
    from ablate.workload.text import text_prompts

    tokenizer = load_tokenizer(model.config)
    prompts = text_prompts(tokenizer, args.num_prompts, args.prompt_len, seed=args.seed, kind=args.prompt_kind)
    # a chat model ends its answer with EOS (<|im_end|>); past it, it makes up a new conversation
    stop = () if args.ignore_eos or tokenizer.eos_id is None else (tokenizer.eos_id,)
    return [Request(i, tuple(p), args.output_len, stop_token_ids=stop) for i, p in enumerate(prompts)]


def explain(arm: dict[str, Any], ar_itl_ms: float) -> list[str]:
    """Why the measured decode speedup and the prediction differ: each factor of the two, compared."""
    k, alpha = arm["k"], arm["alpha"]
    reasons = []
    by_position = [float(x) for x in arm["acceptance_by_position"].split()]
    tested = [x for x in by_position if not math.isnan(x)]
    if len(tested) > 1 and max(tested) - min(tested) > 0.1:
        reasons.append(f"acceptance is not independent across positions: accepted given the earlier ones "
                       f"were, by position 1..{k}: {arm['acceptance_by_position']} (the formula assumes one "
                       f"alpha = {alpha:.3f} at every position)")
    if arm["proposed_per_verification"] < 0.9 * k:
        reasons.append(f"the drafter proposed {arm['proposed_per_verification']:.2f} of k = {k} tokens per step on "
                       "average (no n-gram match, or the end of a request); the formula assumes k every step")
    expected = expected_tokens_per_pass(alpha, k) if not math.isnan(alpha) else math.nan
    reasons.append(f"tokens per target pass: measured {arm['tokens_per_target_forward']:.2f}, "
                   f"expected from alpha {expected:.2f}")
    verify_cost = arm["target_time_per_step_ms"] / ar_itl_ms
    if abs(verify_cost - 1) > 0.1:
        reasons.append(f"a verify pass over k+1 = {k + 1} tokens costs {verify_cost:.2f}x an autoregressive step "
                       "(the formula assumes 1x)")
    overhead = arm["itl_mean_ms"] - arm["draft_time_per_step_ms"] - arm["target_time_per_step_ms"]
    if overhead / ar_itl_ms > 0.1:
        reasons.append(f"{overhead:.1f} ms per step outside the draft and target passes (acceptance, "
                       f"bookkeeping): {overhead / ar_itl_ms:.2f}x an autoregressive step")
    reasons.append(f"step cost in autoregressive steps: measured {arm['itl_mean_ms'] / ar_itl_ms:.2f}, "
                   f"formula k c + 1 = {k * arm['cost_ratio'] + 1:.2f}")
    return reasons


def summarise(runs: dict[str, list[dict[str, Any]]], baseline: str) -> list[dict[str, Any]]:
    base = runs[baseline]
    ar_itl = float(np.median([r["itl_mean_ms"] for r in base]))
    out = []
    for name, rows in runs.items():
        med = lambda key: float(np.median([r[key] for r in rows]))            # noqa: E731
        speedups = [b["duration_s"] / r["duration_s"] for b, r in zip(base, rows)]
        arm: dict[str, Any] = {
            "arm": name, "tok_s": med("output_throughput_tok_s"),
            "speedup": float(np.median(speedups)), "speedup_min": min(speedups), "speedup_max": max(speedups),
            "decode_speedup": float(np.median([b["tpot_mean_ms"] / r["tpot_mean_ms"] for b, r in zip(base, rows)])),
            "tpot_ms": med("tpot_mean_ms"), "itl_mean_ms": med("itl_mean_ms"), "itl_p50_ms": med("itl_p50_ms"),
            "tokens_per_emission": med("tokens_per_emission"),
        }
        if name != baseline:
            for key in ("k", "alpha", "acceptance_rate", "tokens_per_target_forward", "proposed_per_verification",
                        "draft_time_per_step_ms", "target_time_per_step_ms", "cost_ratio", "predicted_speedup"):
                arm[key] = med(f"decoding.{key}")
            arm["k"] = int(arm["k"])
            arm["drafter"] = rows[0]["decoding.drafter"]
            arm["acceptance_by_position"] = rows[-1]["decoding.acceptance_by_position"]   # the same every repeat
            gap = arm["decode_speedup"] / arm["predicted_speedup"] - 1
            arm["measured_vs_predicted"] = gap
            arm["explanation"] = explain(arm, ar_itl) if abs(gap) > DISAGREEMENT else []
        out.append(arm)
    return out


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    registry = default_registry()
    device = dev.resolve(args.device)
    model = load_model(preset(args.model, init=args.init, dtype=args.dtype), device)
    requests = make_requests(args, model)
    arms = make_arms(args, registry)
    engine = EngineConfig(max_num_seqs=1)
    warmup = [replace(r, max_new_tokens=min(r.max_new_tokens, args.warmup_tokens)) for r in requests]
    for arm in arms:
        run_once(arm, model, warmup, engine, registry, None, record=True)
    runs: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    samples: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            run = run_once(arm, model, requests, engine, registry, None, record=True)
            runs[arm.name].append(run.row)
            samples.setdefault(arm.name, [s.output_token_ids for s in run.sequences])
            print(f"repeat {repeat} {arm.name:>16}: {run.row['output_throughput_tok_s']:7.1f} tok/s", flush=True)
    baseline = arms[0].name
    mismatched = [name for name, tokens in samples.items() if tokens != samples[baseline]]
    table = summarise(runs, baseline)
    report(table, baseline, mismatched)
    ngram = [a for a in table if a.get("drafter") == "ngram"]
    best = max(ngram, key=lambda a: a["speedup"]) if ngram else None
    result = {"args": vars(args), "environment": environment(dev.describe(device)), "arms": table,
              "greedy_tokens_differ": mismatched,
              "ngram_best": None if best is None else {"arm": best["arm"], "speedup": best["speedup"],
                                                       "target": NGRAM_TARGET, "met": best["speedup"] >= NGRAM_TARGET}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float))
    print(f"\nwritten: {args.out}")


def report(table: list[dict[str, Any]], baseline: str, mismatched: list[str]) -> None:
    print(f"\n{'arm':>16} {'tok/s':>7} {'speedup':>8} {'decode':>7} {'predicted':>9} {'alpha':>6} "
          f"{'acc.rate':>8} {'tok/pass':>8} {'c':>6} {'TPOT ms':>8} {'ITL ms':>7} {'tok/emit':>8}")
    for a in table:
        spec = a["arm"] != baseline
        print(f"{a['arm']:>16} {a['tok_s']:7.1f} {a['speedup']:7.2f}x {a['decode_speedup']:6.2f}x "
              + (f"{a['predicted_speedup']:8.2f}x {a['alpha']:6.3f} {a['acceptance_rate']:8.3f} "
                 f"{a['tokens_per_target_forward']:8.2f} {a['cost_ratio']:6.3f} " if spec else f"{'':>44} ")
              + f"{a['tpot_ms']:8.1f} {a['itl_mean_ms']:7.1f} {a['tokens_per_emission']:8.2f}")
    for a in table:
        if a.get("explanation"):
            print(f"\n{a['arm']}: decode speedup {a['decode_speedup']:.2f}x vs predicted {a['predicted_speedup']:.2f}x "
                  f"({a['measured_vs_predicted']:+.0%}):")
            for reason in a["explanation"]:
                print(f"  - {reason}")
    if mismatched:
        print(f"\nWARNING: greedy tokens differ from autoregressive decoding for {mismatched}")


if __name__ == "__main__":
    main()
