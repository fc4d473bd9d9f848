"""Does a random model make text? Distinct tokens in greedy continuations and the n-gram drafter's
acceptance, on seeded random weights (LlamaModel.random), from random prompts.

    python benchmarks/random_weight_text.py                         # llama-3.2-1b (16 layers, full width)
    python benchmarks/random_weight_text.py --model tiny
    python benchmarks/random_weight_text.py d_model=256 n_heads=4 n_kv_heads=1 d_ff=1024 vocab_size=32000

A trained model's greedy text varies and n-gram drafts (prompt lookup) are mostly rejected on
prompts without repeats; a random model that repeats one token accepts them all, so any speculative
figure on it is an artifact. The init's reasoning is in LlamaModel.random.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse

import torch

from ablate.api.context import EngineConfig
from ablate.api.plugin import Slot
from ablate.api.sequence import Request
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

NGRAM = {"kv_cache": "contiguous", "decoding": {"name": "speculative", "drafter": "ngram", "k": 4}}


def run(model: LlamaModel, spec: dict, requests: list[Request], max_seq_len: int) -> tuple[list[list[int]], dict]:
    registry = default_registry()
    arm = resolve_arm("text", spec, baseline_configs(registry), registry)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=len(requests)), max_seq_len, registry)
    tokens = [s.output_token_ids for s in built.engine.run(requests)]
    stats = built.plugins[Slot.DECODING].stats()
    built.close()
    return tokens, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="model fields, e.g. n_layers=16 d_model=512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fields = {k: int(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    max_seq_len = args.prompt_len + args.tokens + 8
    cfg = preset(args.model, dtype="fp32", init="random", max_seq_len=max_seq_len, **fields)
    model = LlamaModel.random(cfg)
    gen = torch.Generator().manual_seed(1)
    requests = [Request(i, tuple(torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()),
                        args.tokens) for i in range(args.prompts)]
    greedy, _ = run(model, {"kv_cache": "contiguous"}, requests, max_seq_len)
    drafted, stats = run(model, NGRAM, requests, max_seq_len)
    assert drafted == greedy, "speculative decoding changed greedy tokens"
    print(f"{cfg.name} {fields or ''} layers={cfg.n_layers} d_model={cfg.d_model} vocab={cfg.vocab_size} "
          f"tied={cfg.tied_embeddings}")
    print(f"distinct tokens in {args.tokens} greedy tokens, per prompt: {[len(set(t)) for t in greedy]}")
    print(f"n-gram drafts (k=4): {stats['accepted_tokens']} accepted of {stats['proposed_tokens']} proposed "
          f"(acceptance {stats['acceptance_rate']:.2f})")
    print(f"first prompt's first 16 tokens: {greedy[0][:16]}")


if __name__ == "__main__":
    main()
