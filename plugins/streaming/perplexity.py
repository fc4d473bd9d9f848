"""What StreamingLLM's window costs in perplexity: held-out text scored through each arm's engine.

Teacher forcing (ablate.measure.quality.runner_perplexity): the text goes in one token per step, as
generation would feed it, so the cache evicts exactly as it would while generating. Arms: a
dynamic cache that keeps every token (the reference), and kv_cache=streaming at each window, with
and without attention sinks (the paper's point: a window that evicts its first tokens falls apart).

    python plugins/streaming/perplexity.py                          # SmolLM2-135M, 512 tokens (minutes)
    python plugins/streaming/perplexity.py --tokens 96 --windows 16 --sinks 4,0    # a quick look
"""
from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from ablate.api.context import EngineConfig
from ablate.checkpoints.loader import load_model, load_tokenizer
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.measure.quality import runner_perplexity
from ablate.model.presets import preset
from ablate.workload.text import heldout_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a model preset with a tokenizer")
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens scored")
    parser.add_argument("--windows", default="32,128", help="streaming windows, comma-separated")
    parser.add_argument("--sinks", default="4,0", help="numbers of attention sinks, comma-separated")
    parser.add_argument("--out", default="", help="also write the table to this CSV file")
    args = parser.parse_args()

    registry = default_registry()
    model = load_model(preset(args.model))
    tokens = heldout_tokens(load_tokenizer(model.config), args.tokens)
    arms = {"dynamic": {"kv_cache": "dynamic"}}
    for window in (int(w) for w in args.windows.split(",")):
        for sinks in (int(s) for s in args.sinks.split(",")):
            arms[f"streaming-w{window}-s{sinks}"] = {
                "kv_cache": {"name": "streaming", "window": window, "num_sinks": sinks}}

    rows = []
    for name, spec in arms.items():
        start = time.perf_counter()
        arm = resolve_arm(name, spec, baseline_configs(registry), registry)
        built = build_arm(arm, model, EngineConfig(max_num_seqs=1), len(tokens), registry)
        with torch.inference_mode():
            ppl = runner_perplexity(built.engine.runner, tokens)
        stats = built.kv_cache.stats()
        rows.append({"arm": name, "perplexity": ppl,
                     "most_tokens_held": stats.get("peak_tokens_held", len(tokens) - 1),
                     "tokens_evicted": stats.get("tokens_evicted", 0),
                     "seconds": time.perf_counter() - start})
        built.close()
        print(f"{name}: perplexity {ppl:.3f}", flush=True)
    table = pd.DataFrame(rows)
    table.insert(2, "ratio", table["perplexity"] / table["perplexity"].iloc[0])
    print(f"\n{args.model}, {len(tokens)} held-out tokens, one per step\n")
    print(table.to_markdown(index=False, floatfmt=".3f"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
