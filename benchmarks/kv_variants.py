"""Chapter 13: KV that does not grow with every head. MHA vs GQA vs MQA vs MLA at several ranks.

    .venv/bin/python benchmarks/kv_variants.py                      # SmolLM2-135M (pretrained) and mla-small
    .venv/bin/python benchmarks/kv_variants.py --init random --context 128 --budget-mib 16 \\
        --decode-batch 2 --decode-tokens 4 --ppl-tokens 0 --mla-preset mla-tiny     # a quick check

Per variant of the model (variant plugins: `none`, `gqa:kv_heads=N` mean-pools or repeats K/V
heads, `mla:rank=R,rope_frequencies=F` factorises K/V by SVD; ablate_variants):
- KV bytes per token, from the formula (ModelConfig.kv_cache_widths: 2 L H_kv d_h e; MLA
  L (d_c + d_R) e) and measured: the contiguous cache's buffers (numel x element size) divided
  by the token slots they hold;
- sequences a fixed KV budget admits at `--context` tokens each: the contiguous cache built with
  kv_cache.budget_bytes, sequences admitted until allocate says no (measured), beside
  floor(budget / (context x bytes per token));
- decode throughput at long context: `--decode-batch` sequences of `--context` prompt tokens,
  `--decode-tokens` new tokens each, contiguous cache, attention=sdpa; tokens emitted by pure
  decode steps / their time;
- perplexity on the shipped held-out text (ablate.workload.text, ablate.measure.quality.perplexity), for a
  pretrained model: the quality each KV saving costs, without any fine-tuning. MLA's SVD is
  activation-aware (`--calibration-tokens` of the corpus's prompt part; 0: plain SVD of the
  weights, which at useful ranks costs orders of magnitude of perplexity).
Then the MLA preset (`--mla-preset`, random weights) beside its MHA and GQA twins (same shape with
per-head K/V): bytes, admission and decode throughput.

Figures to reach: MQA from SmolLM2 stores 1/3 of its KV bytes per token; the MLA preset with latent
512 + rope 64 and 128-dim heads at most 1/4 of its MHA twin's; the budget admits correspondingly
more sequences. Results: results/ch13_kv_variants/ (tables, report.md, kv_vs_perplexity.png).
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from ablate.api.context import BuildContext, EngineConfig, KVSpec
from ablate.api.plugin import Slot
from ablate.api.sequence import Request, Sequence
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry, default_registry
from ablate.measure import device as dev
from ablate.measure.recorder import Recorder
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.report.table_run import open_run_folder, store_tables
from ablate.report.wandb_log import WandbConfig

SMOLLM2_VARIANTS = ["gqa:kv_heads=9", "none", "gqa:kv_heads=1",
                    "mla:rank=0,rope_frequencies=16", "mla:rank=192,rope_frequencies=16",
                    "mla:rank=128,rope_frequencies=16", "mla:rank=128,rope_frequencies=8",
                    "mla:rank=64,rope_frequencies=8"]


def parse_variant(spec: str) -> dict:
    """`mla:rank=128,rope_frequencies=8` -> {"name": "mla", "rank": 128, "rope_frequencies": 8}."""
    name, _, options = spec.partition(":")
    fields: dict = {"name": name}
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        fields[key] = int(value)
    return fields


def apply_variant(model: LlamaModel, spec: str, registry: Registry, calibration_tokens: int = 0) -> LlamaModel:
    """The variant applied as the engine applies it; MLA's SVD activation-aware with calibration tokens."""
    fields = parse_variant(spec)
    if fields["name"] == "mla" and calibration_tokens:
        fields.setdefault("calibration_tokens", calibration_tokens)
    config = registry.config(Slot.MODEL, fields["name"], fields)
    engine = EngineConfig(max_num_seqs=1)
    ctx = BuildContext(model, KVSpec.of(model, engine, 1), engine)
    return registry.get(Slot.MODEL, fields["name"])(config, ctx).apply(model)


def contiguous_cache(model: LlamaModel, registry: Registry, context: int, max_num_seqs: int, budget_bytes: int = 0):
    engine = EngineConfig(max_num_seqs=max_num_seqs)
    ctx = BuildContext(model, KVSpec.of(model, engine, context), engine)
    config = registry.config(Slot.KV_CACHE, "contiguous", {"budget_bytes": budget_bytes})
    return registry.get(Slot.KV_CACHE, "contiguous")(config, ctx)


def measured_bytes_per_token(model: LlamaModel, registry: Registry, context: int) -> float:
    """The contiguous cache's buffer bytes per token slot it holds (one sequence of `context`)."""
    cache = contiguous_cache(model, registry, context, max_num_seqs=1)
    measured = cache.bytes_reserved() / (cache.num_slots * cache.capacity)
    cache.close()
    return measured


def admitted_in_budget(model: LlamaModel, registry: Registry, context: int, budget_bytes: int,
                       limit: int = 1 << 16) -> int:
    """Sequences of `context` tokens the cache admits under the budget, one after another."""
    cache = contiguous_cache(model, registry, context, max_num_seqs=limit, budget_bytes=budget_bytes)
    admitted = 0
    while admitted < limit:
        seq = Sequence(Request(admitted, (0,) * (context - 1), max_new_tokens=1))
        seq.start()
        if not cache.allocate(seq, context - 1):
            break
        admitted += 1
    cache.close()
    return admitted


def decode_throughput(model: LlamaModel, spec: str, registry: Registry, context: int, batch: int,
                      new_tokens: int) -> float:
    """Tokens per second of the pure decode steps of `batch` sequences at `context` prompt tokens
    (the variant without calibration: speed does not depend on the weights' values)."""
    arm = resolve_arm(spec, {"variant": parse_variant(spec), "kv_cache": "contiguous", "attention": "sdpa"},
                      baseline_configs(registry), registry)
    recorders: list[Recorder] = []
    built = build_arm(arm, model, EngineConfig(max_num_seqs=batch), context + new_tokens, registry,
                      lambda kv_cache: recorders.append(Recorder(kv_cache)) or recorders)
    gen = torch.Generator().manual_seed(0)
    requests = [Request(i, tuple(torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()),
                        new_tokens) for i in range(batch)]
    built.engine.run(requests)
    built.close()
    decode = [s for s in recorders[0].steps if s.num_prefill_seqs == 0]
    return sum(s.num_seqs for s in decode) / sum(s.end - s.start for s in decode) if decode else float("nan")


def heldout_perplexity(model: LlamaModel, tokens: list[int], window: int) -> float:
    from ablate.measure.quality import perplexity
    return perplexity(model, tokens, window=window, stride=window // 2)


def measure_variant(label: str, model: LlamaModel, spec: str, registry: Registry, args, tokens,
                    name: str | None = None) -> dict:
    """One row: `model` with the variant `spec` applied, shown as `name` (default: the spec)."""
    start = time.perf_counter()
    converted = apply_variant(model, spec, registry, args.calibration_tokens)
    cfg = converted.config
    row = {"model": label, "variant": name or spec, "attention": cfg.attention_kind,
           "kv_heads": cfg.kv_cache_widths[0], "kv_latent_dim": cfg.kv_latent_dim, "rope_head_dim": cfg.rope_head_dim,
           "kv_bytes_per_token_formula": cfg.kv_bytes_per_token(),
           "kv_bytes_per_token_measured": measured_bytes_per_token(converted, registry, args.context)}
    budget = args.budget_mib * 2**20
    row["seqs_admitted"] = admitted_in_budget(converted, registry, args.context, budget)
    row["seqs_predicted"] = budget // (args.context * row["kv_bytes_per_token_formula"])
    if args.decode_batch:
        try:
            row["decode_tok_s"] = decode_throughput(model, spec, registry, args.context, args.decode_batch,
                                                    args.decode_tokens)
        except RuntimeError as err:   # e.g. a cache that cannot hold this variant's K/V layout
            row["decode_tok_s"], row["decode_error"] = float("nan"), f"{type(err).__name__}: {err}"
    if tokens:
        row["perplexity"] = heldout_perplexity(converted, tokens, args.ppl_window)
    row["seconds"] = time.perf_counter() - start
    print(f"{label:>14} {row['variant']:<36} KV {row['kv_bytes_per_token_measured']:>9.0f} B/token "
          f"(formula {row['kv_bytes_per_token_formula']}), {row['seqs_admitted']} seqs admitted"
          + (f", decode {row['decode_tok_s']:.1f} tok/s" if "decode_tok_s" in row else "")
          + (f", ppl {row['perplexity']:.3f}" if "perplexity" in row else ""), flush=True)
    return row


def smollm2_with_tokens(args, device) -> tuple[LlamaModel, list[int]]:
    cfg = preset(args.model, init=args.init, dtype=args.dtype, max_seq_len=max(args.context + args.decode_tokens,
                                                                             args.ppl_window))
    model = load_model(cfg, device)
    if not args.ppl_tokens or args.init != "pretrained":
        return model, []
    from ablate.checkpoints.loader import load_tokenizer
    from ablate.workload.text import heldout_tokens
    return model, heldout_tokens(load_tokenizer(model.config), args.ppl_tokens)


def figure_checks(frame: pd.DataFrame, args) -> list[str]:
    lines = []
    smol = frame[frame["model"] == args.model].set_index("variant")
    if {"none", "gqa:kv_heads=1"} <= set(smol.index):
        ratio = smol.loc["gqa:kv_heads=1", "kv_bytes_per_token_measured"] / smol.loc["none", "kv_bytes_per_token_measured"]
        more = smol.loc["gqa:kv_heads=1", "seqs_admitted"] / max(1, smol.loc["none", "seqs_admitted"])
        lines.append(f"MQA from {args.model}: {ratio:.3f} of its KV bytes per token (target 1/3); "
                     f"the budget admits {more:.2f}x the sequences")
    twins = frame[frame["model"] == args.mla_preset].set_index("variant")
    if {"mla", "mha"} <= set(twins.index):
        ratio = twins.loc["mla", "kv_bytes_per_token_measured"] / twins.loc["mha", "kv_bytes_per_token_measured"]
        more = twins.loc["mla", "seqs_admitted"] / max(1, twins.loc["mha", "seqs_admitted"])
        lines.append(f"{args.mla_preset} (MLA) stores {ratio:.3f} of its MHA twin's KV bytes per token "
                     f"(target <= 1/4); the budget admits {more:.2f}x the sequences")
    return lines


def kv_vs_perplexity_plot(frame: pd.DataFrame, path: Path) -> Path | None:
    rows = frame.dropna(subset=["perplexity"]) if "perplexity" in frame else frame.iloc[0:0]
    if rows.empty:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(rows["kv_bytes_per_token_measured"] / 1024, rows["perplexity"])
    for r in rows.itertuples():
        ax.annotate(r.variant, (r.kv_bytes_per_token_measured / 1024, r.perplexity), fontsize=7)
    ax.set_xlabel("KV KiB per token")
    ax.set_ylabel("perplexity, held-out text")
    ax.set_title("KV bytes per token vs perplexity (no fine-tuning)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--init", default="pretrained", choices=["pretrained", "random"])
    parser.add_argument("--variants", nargs="+", default=SMOLLM2_VARIANTS)
    parser.add_argument("--mla-preset", default="mla-small", help="an MLA preset compared with its MHA/GQA twins")
    parser.add_argument("--gqa-twin-heads", type=int, default=4, help="K/V heads of the MLA preset's GQA twin")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence (admission, decode)")
    parser.add_argument("--budget-mib", type=int, default=512, help="the KV budget admission is measured under")
    parser.add_argument("--decode-batch", type=int, default=4, help="0: skip decode throughput")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens scored; 0: skip perplexity")
    parser.add_argument("--ppl-window", type=int, default=1024)
    parser.add_argument("--calibration-tokens", type=int, default=2048,
                        help="MLA's activation-aware SVD over this many tokens of the corpus's prompt part; 0: plain SVD")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    registry = default_registry()
    device = dev.resolve(args.device)
    rows = []
    with torch.inference_mode():
        model, tokens = smollm2_with_tokens(args, device)
        for spec in args.variants:
            rows.append(measure_variant(args.model, model, spec, registry, args, tokens))
        del model
        if args.mla_preset:
            mla_cfg = preset(args.mla_preset, dtype=args.dtype, max_seq_len=args.context + args.decode_tokens)
            per_head = dict(attention_kind="mha", kv_latent_dim=0, rope_head_dim=0, q_lora_rank=0, v_head_dim=0,
                            latent_norms=False)     # every MLA field off (DeepSeek's presets set them all)
            twins = {"mla": mla_cfg, "mha": replace(mla_cfg, **per_head),
                     "gqa": replace(mla_cfg, **per_head, n_kv_heads=args.gqa_twin_heads)}
            for name, cfg in twins.items():
                rows.append(measure_variant(args.mla_preset, LlamaModel.random(cfg, device), "none", registry,
                                            args, [], name))
    frame = pd.DataFrame(rows)
    checks = figure_checks(frame, args)
    columns = [c for c in ("model", "variant", "kv_heads", "kv_latent_dim", "rope_head_dim",
                           "kv_bytes_per_token_formula", "kv_bytes_per_token_measured", "seqs_admitted",
                           "seqs_predicted", "decode_tok_s", "perplexity", "decode_error") if c in frame]
    print("\n" + frame[columns].to_string(index=False) + "\n\n" + "\n".join(checks))
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir", "wandb")}
    folder = open_run_folder(args.results_dir, "ch13_kv_variants", config, device)
    plot = kv_vs_perplexity_plot(frame, folder.path / "kv_vs_perplexity.png")
    report = "\n".join(["# ch13: KV bytes per token, admission, decode throughput and perplexity", "",
                        frame[columns].to_markdown(index=False), "", *[f"- {c}" for c in checks],
                        f"- budget {args.budget_mib} MiB, {args.context} tokens per sequence, dtype {args.dtype}"]
                       + ([f"- ![KV vs perplexity]({plot.name})"] if plot else [])) + "\n"
    summary = {f"kv_bytes_per_token/{r.model}/{r.variant}": float(r.kv_bytes_per_token_measured)
               for r in frame.itertuples()}
    wandb_dir = store_tables(folder, experiment="ch13_kv_variants", chapter="ch13", config=config,
                             tables={"variants": frame}, report=report, summary=summary,
                             wandb=WandbConfig(mode=args.wandb), tags=[args.model, args.mla_preset],
                             images={"kv_vs_perplexity": plot} if plot else None)
    print(f"\nresults: {folder.path}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))


if __name__ == "__main__":
    main()
