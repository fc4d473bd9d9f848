"""What a sliding window saves in the KV cache, measured: bytes held per sequence, rings against blocks.

    .venv/bin/python benchmarks/windowed_kv.py [--window 128] [--lengths 512 2048] [--step-tokens 128] [--out DIR]

Random transformers models with windows (ablate.testing.hf_models: Mistral, every layer windowed; Gemma 2,
one layer of two), saved and read back by ablate, hidden 256, 4 layers. One sequence of n prompt tokens
and 16 new ones, chunked prefill of --step-tokens tokens a step, through the contiguous cache (a
windowed layer keeps a ring of R = window - 1 + step tokens rows: ablate_kv_cache.slot_cache) and the
paged one (a windowed layer's blocks from its window on: ablate_kv_cache.paged). Per row: the bytes each
cache holds at the end (KVCache.bytes_reserved, the contiguous cache's rows sized for this sequence
alone), the most the paged cache held during a step (its blocks' peak), the live K/V the contiguous cache reports
(bytes_used) against ModelConfig.kv_bytes_at(n) and against n tokens in every layer, and whether the two
caches' greedy tokens agree with transformers' own (the window applied, not just stored).
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints import load_model
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.testing.hf_models import build_hf, greedy, hf_logits, pretrained, random_prompt, save_hf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
NEW_TOKENS = 16


def run(model, kv_cache: str, prompt: list[int], step_tokens: int, registry) -> tuple[list[int], int, int, dict]:
    """(greedy tokens, bytes reserved at the end, live bytes at the end, the cache's stats) of one sequence."""
    arm = resolve_arm(kv_cache, {"kv_cache": kv_cache, "attention": "sdpa"}, baseline_configs(registry), registry)
    engine = EngineConfig(max_num_seqs=1, max_num_batched_tokens=step_tokens)
    built = build_arm(arm, model, engine, len(prompt) + NEW_TOKENS, registry)
    held = {}
    try:
        cache = built.engine.runner.kv_cache
        commit = cache.keep

        def measured_keep(seq, num_tokens):          # the bytes after each commit; the last one stays
            commit(seq, num_tokens)
            held.update(reserved=cache.bytes_reserved(), used=cache.bytes_used())
        cache.keep = measured_keep
        [seq] = built.engine.run([Request(0, tuple(prompt), NEW_TOKENS)])
        return list(seq.output_token_ids), held["reserved"], held["used"], cache.stats()
    finally:
        built.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--step-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    registry, rows = default_registry(), []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mistral", "gemma2"):
            hf = build_hf(kind, **SHAPE, sliding_window=args.window)
            path = save_hf(hf, Path(tmp) / kind, sharded=False)
            model = load_model(replace(pretrained(path), max_seq_len=SHAPE["max_position_embeddings"]))
            cfg = model.config
            for n in args.lengths:
                prompt = random_prompt(n, vocab_size=cfg.vocab_size)
                want = greedy(hf_logits(hf), prompt, NEW_TOKENS)
                ring_tokens, ring_reserved, ring_used, _ = run(model, "contiguous", prompt, args.step_tokens, registry)
                paged_tokens, paged_reserved, _, paged = run(model, "paged", prompt, args.step_tokens, registry)
                total = n + NEW_TOKENS - 1               # tokens whose K/V is kept (the last is never fed)
                rows.append({
                    "kind": kind, "window": args.window, "windowed_layers": sum(
                        cfg.layer_window(layer) is not None for layer in range(cfg.n_layers)),
                    "layers": cfg.n_layers, "tokens": total, "ring_rows": args.window - 1 + args.step_tokens,
                    "contiguous_reserved_mib": ring_reserved / 2**20, "paged_reserved_mib": paged_reserved / 2**20,
                    "paged_peak_mib": paged["kv_blocks_used_peak"] * paged["kv_block_bytes"] / 2**20,
                    "saved": 1 - ring_reserved / paged_reserved,
                    "live_bytes": ring_used, "kv_bytes_at": cfg.kv_bytes_at(total),
                    "every_token_bytes": total * cfg.kv_bytes_per_token(),
                    "contiguous_agrees_with_transformers": ring_tokens == want,
                    "paged_agrees_with_transformers": paged_tokens == want,
                })
    table = pd.DataFrame(rows)
    print(table.to_markdown(index=False, floatfmt=".3g"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "windowed_kv.csv", index=False)


if __name__ == "__main__":
    main()
