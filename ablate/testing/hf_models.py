"""Small random Hugging Face models of each architecture ablate reads, built offline by transformers.

One builder per kind: the parity tests (tests/test_checkpoints.py and the per-architecture test
files) and benchmarks/model_parity.py load each into ablate from a saved directory and compare its
logits, greedy text and perplexity with transformers' own on the same weights.

Weights are drawn large enough that greedy continuations vary (transformers' 0.02-std init makes
them repeat one token), and norms and biases away from 1 and 0, so that a mis-mapped one shows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# the shape every kind starts from: two layers, four query heads over two K/V heads
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10_000.0}


# kind -> (transformers' config class, its causal-LM class, the config's fields beyond SMALL).
# build_hf(kind, **shape) changes the shape (benchmarks/model_parity.py times a wider one)
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=False, rope_theta=10_000.0)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=True, rope_theta=10_000.0)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=False, rope_theta=10_000.0,
                                                          rope_scaling=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64, tie_word_embeddings=False)),
    # Q, K, V in one qkv_proj; gate and up in one gate_up_proj
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # q/k norms per head; a head_dim of its own (not d_model / n_heads)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
}


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Projections N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.2^2), biases N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)                     # biases, and per-expert or per-channel vectors
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def build_hf(kind: str, seed: int = 0, **shape: Any) -> torch.nn.Module:
    """A random transformers model of `kind` (a key of KINDS), in eval mode; `shape` overrides config
    fields (hidden_size=512, num_hidden_layers=4...)."""
    import transformers

    if kind not in KINDS:
        raise ValueError(f"no random model kind {kind!r}; the kinds are {', '.join(KINDS)}")
    config_class, model_class, fields = KINDS[kind]
    config = getattr(transformers, config_class)(**(SMALL | fields | shape))
    model = getattr(transformers, model_class)(config)
    randomise(model, seed)
    return model.eval()


def save_hf(model: torch.nn.Module, directory: Path, sharded: bool = True) -> Path:
    """save_pretrained into `directory`, in 60 KB shards (an index file and several safetensors) or one file."""
    model.save_pretrained(directory, max_shard_size="60KB" if sharded else "1GB")
    return directory
