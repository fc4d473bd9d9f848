"""ablate's engine against the engines users deploy, on the same weights, prompts and lengths.

    .venv/bin/python benchmarks/vs_engines.py [--batch 1 8] [--repeats 5] [--out DIR] [--extra 'threads=2']

Runs `python -m ablate +experiment=engines` once per batch size (engine.max_num_seqs = the batch,
workload.num_requests = the batch x 2: two batches a round), each as its own process: ablate's arms,
transformers' generate (dynamic cache, static cache, prompt lookup) and llama.cpp (the F32 rewrite of
the GGUF, and the shipped Q4_1, a different byte budget) interleaved round by round. Then one table:

    engine | precision | batching | batch | tok/s | TPOT p50 | ratio to ablate [95% CI] | agreement | status

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


def run_batch(batch: int, repeats: int, results: Path, extra: list[str]) -> Path:
    command = [sys.executable, "-m", "ablate", "+experiment=engines", f"engine.max_num_seqs={batch}",
               f"workload.num_requests={2 * batch}", f"experiment.repeats={repeats}", f"results_dir={results}",
               f"experiment.name=engines_b{batch}", "redo=true", f"hydra.run.dir={results}/hydra/b{batch}", *extra]
    if batch > 1:
        command += [f"~experiment.arms.{arm}" for arm in BATCH_1_ONLY]
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    (run,) = sorted((results / f"engines_b{batch}").glob("*/summary.csv"))
    return run.parent


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
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_engines-"))
    bandwidth = measure_read_bandwidth() / 1e9
    frames = []
    for batch in args.batch:
        run = run_batch(batch, args.repeats, out, shlex.split(args.extra))
        frame = table(run, batch)
        weights = pd.read_csv(run / "runs.csv").query("arm == 'ablate'")["weight_bytes"].iloc[0]
        tpot = frame.query("arm == 'ablate'")["TPOT p50 ms"].iloc[0]
        print(f"batch {batch}: ablate's decode step reads {weights / 1e6:.0f} MB of weights in {tpot:.1f} ms "
              f"(TPOT p50): {weights / tpot / 1e6:.1f} GB/s, {weights / tpot / 1e6 / bandwidth:.0%} of the "
              f"{bandwidth:.1f} GB/s read bandwidth measured here")
        frames.append(frame)
    result = pd.concat(frames, ignore_index=True)
    print(result.to_markdown(index=False, floatfmt=".3g"))
    result.assign(read_bandwidth_gb_s=bandwidth).to_csv(out / "vs_engines.csv", index=False)
    print(f"tables and runs: {out}")


if __name__ == "__main__":
    main()
