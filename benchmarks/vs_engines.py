"""ablate's engine against the engines users deploy, on the same weights, prompts and lengths.

    .venv/bin/python benchmarks/vs_engines.py [--batch 1 8] [--repeats 5] [--dtype fp32|bf16] [--out DIR] [--extra 'threads=2']

Runs `python -m ablate +experiment=engines` once per batch size (engine.max_num_seqs = the batch,
workload.num_requests = the batch x 2: two batches a round), each as its own process: ablate's arms,
transformers' generate (dynamic cache, static cache, prompt lookup) and llama.cpp (the F32 rewrite of
the GGUF, and the shipped Q4_1, a different byte budget) interleaved round by round. Then one table:

    engine | precision | batching | batch | tok/s | TPOT p50 | ratio to ablate [95% CI] | agreement | status

--dtype bf16 runs the same in bf16, on a CPU with AMX or AVX512-BF16 (elsewhere ablate refuses it): ablate
and transformers in bf16, llama.cpp on the weights rewritten in BF16 (the same numbers as torch's cast)
and vLLM in bf16, without the speculative arms; beside the table, the quality bf16 cost: the
perplexity of SmolLM2 in bf16 over fp32 on held-out text (ablate.workload.text).

ratio = ablate's time / the arm's per round (above 1: the arm is faster), geometric mean and t-interval
over the rounds. Beside it the machine's read bandwidth, measured here with a 1 GiB buffer, and
ablate's decode step against it (weights read per step / TPOT p50 / bandwidth). An engine that is not
installed shows as skipped (pip install -e ".[hf,llamacpp]").
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from ablate.measure.device import measure_read_bandwidth

REPO = Path(__file__).resolve().parent.parent
# speculative arms, run at batch 1 only: transformers' prompt lookup serves one request at a time, and
# speculation is a latency technique; the batched table compares the engines' plain decoding
BATCH_1_ONLY = ("ablate_ngram_k4", "hf_prompt_lookup")


# in bf16: llama.cpp on a BF16 rewrite of the same weights in place of its F32 and Q4_1 files; ablate on a
# contiguous cache under SDPA (the paged-attention kernel reads fp32 caches only; a bf16 paged cache would be
# gathered for SDPA every step), so its second arm goes
BF16_ARMS = ["~experiment.arms.llamacpp_f32", "~experiment.arms.llamacpp_q4_1",
             "+experiment.arms.llamacpp_bf16={engine: {name: llamacpp, weights: bf16}}",
             "kv_cache=contiguous", "attention=sdpa", "~experiment.arms.ablate_contiguous_sdpa"]


def run_batch(batch: int, repeats: int, results: Path, extra: list[str], dtype: str = "fp32") -> Path:
    name = f"engines_b{batch}" + ("_bf16" if dtype == "bf16" else "")
    command = [sys.executable, "-m", "ablate", "+experiment=engines", f"engine.max_num_seqs={batch}",
               f"workload.num_requests={2 * batch}", f"experiment.repeats={repeats}", f"results_dir={results}",
               f"experiment.name={name}", "redo=true", f"hydra.run.dir={results}/hydra/{name}", *extra]
    if batch > 1 or dtype == "bf16":
        command += [f"~experiment.arms.{arm}" for arm in BATCH_1_ONLY]
    if dtype == "bf16":
        command += ["model.dtype=bf16", *BF16_ARMS]
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    (run,) = sorted((results / name).glob("*/summary.csv"))
    return run.parent


def bf16_perplexity_ratio(num_tokens: int = 2048) -> float:
    """SmolLM2's perplexity in bf16 over fp32 on `num_tokens` held-out tokens: what bf16 costs in quality."""
    from ablate.checkpoints import load_model
    from ablate.checkpoints.loader import load_tokenizer
    from ablate.measure.quality import perplexity
    from ablate.model.presets import preset
    from ablate.workload.text import heldout_tokens

    fp32 = load_model(preset("smollm2-135m", dtype="fp32"))
    tokens = heldout_tokens(load_tokenizer(fp32.config), num_tokens)
    ppl32 = perplexity(fp32, tokens)
    del fp32
    return perplexity(load_model(preset("smollm2-135m", dtype="bf16")), tokens) / ppl32


def _first(*values):
    """The first value that is given (not None, not NaN: a column other arms' rows fill)."""
    return next((v for v in values if v is not None and not (isinstance(v, float) and v != v)), "")


def table(run: Path, batch: int) -> pd.DataFrame:
    summary, runs = pd.read_csv(run / "summary.csv"), pd.read_csv(run / "runs.csv")
    first = runs.groupby("arm").first()
    rows = []
    for r in summary.itertuples():
        arm = first.loc[r.arm]
        engine = r.label.split()[0].removeprefix("engine=") if str(r.label).startswith("engine=") else "ablate"
        ok = r.status in ("ok", "degraded")
        rows.append({
            "engine": engine, "arm": r.arm,
            "precision": _first(arm.get("engine.precision"), arm.get("dtype")) if ok else "",
            "batching": _first(arm.get("engine.batching"),
                               "continuous" if "scheduler=continuous" in str(r.label) else "static"),
            "batch": batch, "tok/s": r.output_throughput_tok_s, "TPOT p50 ms": r.tpot_p50_ms,
            # a degraded arm (it lost quality) has no speedup: its time ratio is shown, with its status beside it
            **({"ratio to ablate": r.speedup, "CI low": r.speedup_ci_low, "CI high": r.speedup_ci_high}
               if r.status != "degraded" else
               {"ratio to ablate": r.time_ratio, "CI low": r.time_ratio_ci_low, "CI high": r.time_ratio_ci_high}),
            "rounds": r.speedup_rounds,
            "agreement": r.token_agreement, "status": r.status,
        })
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="where the runs and the table go (default: a temp dir)")
    parser.add_argument("--extra", default="", help="more Hydra overrides for every run, e.g. 'threads=2'")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_engines-"))
    bandwidth = measure_read_bandwidth() / 1e9
    frames = []
    for batch in args.batch:
        run = run_batch(batch, args.repeats, out, shlex.split(args.extra), args.dtype)
        frame = table(run, batch)
        weights = pd.read_csv(run / "runs.csv").query("arm == 'ablate'")["weight_bytes"].iloc[0]
        tpot = frame.query("arm == 'ablate'")["TPOT p50 ms"].iloc[0]
        print(f"batch {batch}: ablate's decode step reads {weights / 1e6:.0f} MB of weights in {tpot:.1f} ms "
              f"(TPOT p50): {weights / tpot / 1e6:.1f} GB/s, {weights / tpot / 1e6 / bandwidth:.0%} of the "
              f"{bandwidth:.1f} GB/s read bandwidth measured here")
        frames.append(frame)
    result = pd.concat(frames, ignore_index=True)
    print(result.to_markdown(index=False, floatfmt=".3g"))
    if args.dtype == "bf16":
        ratio = bf16_perplexity_ratio()
        print(f"quality: SmolLM2's perplexity in bf16 is {ratio:.4f}x its fp32 one on 2048 held-out tokens")
        result = result.assign(bf16_ppl_ratio=ratio)
    result.assign(read_bandwidth_gb_s=bandwidth).to_csv(out / "vs_engines.csv", index=False)
    print(f"tables and runs: {out}")


if __name__ == "__main__":
    main()
