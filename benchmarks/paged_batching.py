"""What paging and continuous batching buy, measured side by side in one run.

    .venv/bin/python benchmarks/paged_batching.py --out results/paged_batching.json          # full size
    .venv/bin/python benchmarks/paged_batching.py --quick                                     # a minute, tiny model

(a) Paging. A KV budget that holds 8 sequences of the maximum length (max_len tokens); requests with
    prompt max_len/16 +- max_len/32 and exponential outputs, so the mean length is max_len/4; all
    arrive at once, more than the budget holds. Contiguous (reserves max_len per sequence) vs paged
    (claims blocks of --block-size as sequences grow), both under the continuous scheduler:
    KV utilisation = used / reserved (time-weighted), sequences held at once while requests queue
    (the capacity the budget gives; paged / contiguous ratio), each beside the paging model's prediction.
(b) Batching. --batching-requests requests, exponential output lengths (mean 64, cap 256), paged
    cache for both arms, engine.max_num_seqs = --max-num-seqs (the batch a static scheduler fills):
    arriving at once, continuous vs static output throughput; then Poisson arrivals at
    --rate-factor x the static scheduler's capacity (requests / second it completed in the burst):
    TTFT p99 static / continuous.
Each figure is the median over --repeats runs, arms alternating order. Targets (issue 4) are printed
beside them.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ablate.api.context import EngineConfig
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.engine.registry import default_registry
from ablate.experiment.run import run_once
from ablate.measure import device as dev
from ablate.model.presets import preset
from ablate.workload.requests import WorkloadConfig, make_requests

BUDGET_SEQS = 8     # the budget holds this many sequences of the maximum length


def median_rows(arms: dict, requests, engine: EngineConfig, model, registry, repeats: int) -> dict[str, dict]:
    """Run every arm `repeats` times, alternating the order; per arm the median of each numeric figure."""
    rows: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(repeats):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            run = run_once(arms[name], model, requests, engine, registry, None, record=True)
            rows[name].append(run.row)
            print(f"  {name} run {r}: {run.row['duration_s']:.2f} s, {run.row['output_throughput_tok_s']:.1f} tok/s")
    return {name: {k: float(np.median([row[k] for row in runs])) for k in runs[0]
                   if isinstance(runs[0][k], (int, float, np.floating, np.integer))}
            for name, runs in rows.items()}


def paging(args, model, registry) -> dict:
    max_len = args.max_len
    prompt, spread = max_len // 16, max_len // 32
    workload = WorkloadConfig(num_requests=args.paging_requests, prompt_len=prompt, prompt_dist="uniform",
                              prompt_spread=spread, output_len=max_len // 4 - prompt, output_dist="exponential",
                              output_len_max=max_len - prompt - spread, arrival="burst", seed=args.seed)
    budget = BUDGET_SEQS * max_len * model.config.kv_bytes_per_token()
    base = baseline_configs(registry)
    arms = {name: resolve_arm(name, {"kv_cache": {"name": name, "budget_bytes": budget, **extra},
                                     "scheduler": "continuous", "attention": "sdpa"}, base, registry)
            for name, extra in (("contiguous", {}), ("paged", {"block_size": args.block_size}))}
    engine = EngineConfig(max_num_seqs=args.paging_max_num_seqs, max_seq_len=max_len)
    requests = make_requests(workload, model.config.vocab_size)
    lengths = [len(r.prompt_token_ids) + r.max_new_tokens for r in requests]
    print(f"(a) paging: budget {budget:,} bytes = {BUDGET_SEQS} x {max_len} tokens; {len(requests)} requests, "
          f"mean length {np.mean(lengths):.1f} (max {max_len}, longest {max(lengths)})")
    med = median_rows(arms, requests, engine, model, registry, args.repeats)
    c, p = med["contiguous"], med["paged"]
    return {
        "budget_bytes": budget, "max_len": max_len, "block_size": args.block_size,
        "mean_length": float(np.mean(lengths)),
        "contiguous_kv_util": c["kv_util_mean"], "paged_kv_util": p["kv_util_mean"],
        "contiguous_kv_util_predicted": c["kv_cache.predicted_kv_util"],
        "paged_kv_util_predicted": p["kv_cache.predicted_kv_util"],
        "contiguous_seqs_at_once": c["seqs_admitted_while_queued"],
        "paged_seqs_at_once": p["seqs_admitted_while_queued"],
        "contiguous_seqs_at_once_predicted": c["kv_cache.predicted_seqs_admitted"],
        "paged_seqs_at_once_predicted": p["kv_cache.predicted_seqs_admitted"],
        "seqs_at_once_ratio": p["seqs_admitted_while_queued"] / c["seqs_admitted_while_queued"],
        "paged_peak_seqs": p["seqs_admitted_max"], "paged_preemptions": p["preemptions"],
        "paged_waste_slots_per_seq": p["kv_cache.kv_frag_slots_per_seq_mean"],
        "paged_waste_slots_per_seq_predicted": p["kv_cache.predicted_frag_slots_per_seq"],
        "contiguous_tok_s": c["output_throughput_tok_s"], "paged_tok_s": p["output_throughput_tok_s"],
    }


def batching(args, model, registry) -> dict:
    workload = WorkloadConfig(num_requests=args.batching_requests, prompt_len=args.prompt_len,
                              output_len=args.output_mean, output_dist="exponential", output_len_max=args.output_cap,
                              arrival="burst", seed=args.seed)
    base = baseline_configs(registry)
    arms = {name: resolve_arm(name, {"kv_cache": "paged", "attention": "sdpa", "scheduler": name}, base, registry)
            for name in ("static", "continuous")}
    engine = EngineConfig(max_num_seqs=args.max_num_seqs)
    print(f"(b) batching: {workload.num_requests} requests at once, prompt {args.prompt_len}, output exponential "
          f"mean {args.output_mean} cap {args.output_cap}, max_num_seqs {args.max_num_seqs}")
    burst = median_rows(arms, make_requests(workload, model.config.vocab_size), engine, model, registry, args.repeats)
    capacity = burst["static"]["request_throughput_req_s"]
    rate = args.rate_factor * capacity
    print(f"    Poisson arrivals at {rate:.3f} requests/s = {args.rate_factor} x the static capacity {capacity:.3f}")
    poisson = replace(workload, arrival="poisson", rate=rate)
    timed = median_rows(arms, make_requests(poisson, model.config.vocab_size), engine, model, registry, args.repeats)
    s, c = burst["static"], burst["continuous"]
    return {
        "static_tok_s": s["output_throughput_tok_s"], "continuous_tok_s": c["output_throughput_tok_s"],
        "throughput_ratio": c["output_throughput_tok_s"] / s["output_throughput_tok_s"],
        "static_capacity_req_s": capacity, "poisson_rate_req_s": rate,
        "static_ttft_p99_ms": timed["static"]["ttft_p99_ms"],
        "continuous_ttft_p99_ms": timed["continuous"]["ttft_p99_ms"],
        "ttft_p99_ratio": timed["static"]["ttft_p99_ms"] / timed["continuous"]["ttft_p99_ms"],
        "static_queue_p99_ms": timed["static"]["queue_p99_ms"],
        "continuous_queue_p99_ms": timed["continuous"]["queue_p99_ms"],
    }


def table(figures: dict) -> list[tuple[str, str, str]]:
    """(figure, measured, target) rows."""
    a, b = figures.get("paging"), figures.get("batching")
    rows = []
    if a:
        rows += [
            ("paged KV util (pred)", f"{a['paged_kv_util']:.1%} ({a['paged_kv_util_predicted']:.1%})", ">= 90%"),
            ("contiguous KV util (pred)", f"{a['contiguous_kv_util']:.1%} ({a['contiguous_kv_util_predicted']:.1%})",
             "<= 35%"),
            ("seqs at once paged / contiguous (pred)",
             f"{a['paged_seqs_at_once']:.1f} / {a['contiguous_seqs_at_once']:.1f} = {a['seqs_at_once_ratio']:.2f}x "
             f"({a['paged_seqs_at_once_predicted']:.0f} / {a['contiguous_seqs_at_once_predicted']:.0f})", ">= 2.5x"),
            ("paged waste slots/seq (pred)",
             f"{a['paged_waste_slots_per_seq']:.1f} ({a['paged_waste_slots_per_seq_predicted']:.1f})", "~ block/2"),
            ("output tok/s contiguous -> paged", f"{a['contiguous_tok_s']:.1f} -> {a['paged_tok_s']:.1f}", ""),
        ]
    if b:
        rows += [
            ("output tok/s static -> continuous",
             f"{b['static_tok_s']:.1f} -> {b['continuous_tok_s']:.1f} = {b['throughput_ratio']:.2f}x", ">= 1.5x"),
            ("TTFT p99 ms static / continuous",
             f"{b['static_ttft_p99_ms']:.0f} / {b['continuous_ttft_p99_ms']:.0f} = {b['ttft_p99_ratio']:.2f}x",
             ">= 3x"),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a model preset (random weights)")
    parser.add_argument("--part", choices=("all", "paging", "batching"), default="all")
    parser.add_argument("--max-len", type=int, default=512, help="(a) longest sequence: prompt + output")
    parser.add_argument("--block-size", type=int, default=16, help="(a) paged block size")
    parser.add_argument("--paging-requests", type=int, default=96, help="(a) requests, arriving at once")
    parser.add_argument("--paging-max-num-seqs", type=int, default=64, help="(a) slots: above what the budget holds")
    parser.add_argument("--batching-requests", type=int, default=64, help="(b) requests")
    parser.add_argument("--prompt-len", type=int, default=64, help="(b) prompt tokens")
    parser.add_argument("--output-mean", type=int, default=64, help="(b) mean output tokens (exponential)")
    parser.add_argument("--output-cap", type=int, default=256, help="(b) longest output")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="(b) engine.max_num_seqs for both schedulers")
    parser.add_argument("--rate-factor", type=float, default=1.0, help="(b) Poisson rate / static capacity")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and sizes: checks the script works, figures mean little")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.model, args.max_len, args.paging_requests, args.paging_max_num_seqs = "tiny", 128, 64, 48
        args.batching_requests, args.prompt_len, args.output_mean, args.output_cap = 12, 16, 16, 48
        args.max_num_seqs, args.repeats = 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    registry = default_registry()
    device = dev.resolve(args.device)
    model = load_model(preset(args.model, init="random"), device)
    figures: dict = {"config": vars(args), "device": dev.describe(device)}
    if args.part in ("all", "paging"):
        figures["paging"] = paging(args, model, registry)
    if args.part in ("all", "batching"):
        figures["batching"] = batching(args, model, registry)
    rows = table(figures)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  measured  [target]")
    for name, measured, target in rows:
        print(f"{name:<{width}}  {measured}" + (f"  [{target}]" if target else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str))
        print(f"\nfigures: {args.out}")


if __name__ == "__main__":
    main()
