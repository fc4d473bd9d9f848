"""Mixture-of-experts checkpoints: Mixtral, Qwen2-MoE and Qwen3-MoE (ablate/model/moe.py has the maths).

What config.json gives, beyond the Llama-family keys hf.py reads:

    mixtral     num_local_experts -> n_experts, num_experts_per_tok -> n_experts_per_token;
                intermediate_size is each expert's width; the top-k weights always renormalised
    qwen2_moe   num_experts, num_experts_per_tok, moe_intermediate_size -> expert_d_ff,
                shared_expert_intermediate_size -> shared_expert_d_ff (with its sigmoid gate),
                norm_topk_prob; intermediate_size is the dense layers' width; biases on Q, K, V
    qwen3_moe   as qwen2_moe without the shared expert, with Qwen3's per-head q/k norms

Qwen's dense layers among the MoE ones: layer i is dense when it is in mlp_only_layers or
(i + 1) % decoder_sparse_step != 0 -> dense_layers.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _error(message: str) -> Exception:
    from ablate.checkpoints.hf import CheckpointError    # hf.py imports this module
    return CheckpointError(message)


def _whole(config: dict[str, Any], path: Path, key: str, low: int = 1) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _error(f"{path}: {key} must be a whole number >= {low}, got {value!r}")
    return value


def moe_fields(config: dict[str, Any], directory: str | os.PathLike) -> dict[str, Any]:
    """ModelConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json's experts, each bad value
    refused naming the file and the key."""
    path = Path(directory) / "config.json"
    model_type = config["model_type"]
    experts_key = "num_local_experts" if model_type == "mixtral" or "num_experts" not in config else "num_experts"
    num_experts = _whole(config, path, experts_key)
    top_k = _whole(config, path, "num_experts_per_tok")
    if top_k > num_experts:
        raise _error(f"{path}: num_experts_per_tok ({top_k}) must be at most {experts_key} ({num_experts})")
    if model_type == "mixtral":
        return dict(n_experts=num_experts, n_experts_per_token=top_k, expert_d_ff=int(config["intermediate_size"]))
    norm = config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise _error(f"{path}: norm_topk_prob must be true or false, got {norm!r}")
    shared = _whole(config, path, "shared_expert_intermediate_size", low=0) if model_type == "qwen2_moe" else 0
    step = _whole(config, path, "decoder_sparse_step") if "decoder_sparse_step" in config else 1
    only = config.get("mlp_only_layers") or []
    layers = int(config["num_hidden_layers"])
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in only):
        raise _error(f"{path}: mlp_only_layers must list layers 0..{layers - 1}, got {only!r}")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    return dict(n_experts=num_experts, n_experts_per_token=top_k,
                expert_d_ff=_whole(config, path, "moe_intermediate_size"), shared_expert_d_ff=shared,
                shared_expert_gate=shared > 0, norm_topk_prob=norm, dense_layers=dense or None)
