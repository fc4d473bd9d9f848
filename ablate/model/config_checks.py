"""The checks of ModelConfig's fields for the families beyond Llama's (Gemma's features, mixtures of
experts and DeepSeek's routing): each raises a ValueError naming the field, what it got and what
would be right. Called by ModelConfig.__post_init__."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ablate.model.config import ModelConfig


def check_gemma_features(cfg: ModelConfig) -> None:
    if cfg.mlp_activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"model.mlp_activation must be 'silu' or 'gelu_tanh', got {cfg.mlp_activation!r}")
    for name in ("attn_softcap", "final_softcap", "rope_local_base"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"model.{name} must be a finite number >= 0 (0: off), got {value!r}")
    if not (math.isfinite(cfg.rope_linear_factor) and cfg.rope_linear_factor > 0):
        raise ValueError(f"model.rope_linear_factor must be a finite number > 0, got {cfg.rope_linear_factor!r}")
    if cfg.sliding_window < 0:
        raise ValueError(f"model.sliding_window must be >= 0 (0: no window), got {cfg.sliding_window}")
    if cfg.window_layers is not None:
        if not cfg.sliding_window:
            raise ValueError("model.window_layers names the layers that slide, but model.sliding_window is 0")
        bad = [i for i in cfg.window_layers if not 0 <= i < cfg.n_layers]
        if bad:
            raise ValueError(f"model.window_layers must be layers 0..{cfg.n_layers - 1}, got {bad}")
    if cfg.attention_kind == "mla" and (cfg.sliding_window or cfg.attn_softcap):
        raise ValueError("model.attention_kind=mla supports neither model.sliding_window nor model.attn_softcap")


def check_experts(cfg: ModelConfig) -> None:
    for name in ("n_experts", "n_experts_per_token", "expert_d_ff", "shared_expert_d_ff"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"model.{name} must be a whole number >= 0, got {value!r}")
    for name in ("shared_expert_gate", "norm_topk_prob"):     # before they are read as truth values
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"model.{name} must be true or false, got {getattr(cfg, name)!r}")
    if not cfg.n_experts:
        moe_only = [n for n in ("n_experts_per_token", "expert_d_ff", "shared_expert_d_ff") if getattr(cfg, n)]
        if moe_only or cfg.shared_expert_gate or cfg.dense_layers is not None:
            raise ValueError(f"model.{', model.'.join(moe_only) or 'shared_expert_gate/dense_layers'} set but "
                             "model.n_experts is 0 (a dense model): set model.n_experts, or leave them at their defaults")
        return
    if not 1 <= cfg.n_experts_per_token <= cfg.n_experts:
        raise ValueError(f"model.n_experts_per_token must be 1..model.n_experts ({cfg.n_experts}), "
                         f"got {cfg.n_experts_per_token}")
    if cfg.shared_expert_gate and not cfg.shared_expert_d_ff:
        raise ValueError("model.shared_expert_gate gates a shared expert, but model.shared_expert_d_ff is 0 (none)")
    bad = [i for i in cfg.dense_layers or () if not 0 <= i < cfg.n_layers]
    if bad:
        raise ValueError(f"model.dense_layers must be layers 0..{cfg.n_layers - 1}, got {bad}")
    if cfg.architecture != "llama":
        raise ValueError("model.n_experts: mixtures of experts are built for model.architecture=llama only")


def check_routing(cfg: ModelConfig) -> None:
    if cfg.moe_router not in ("softmax", "deepseek_v2", "deepseek_v3"):
        raise ValueError(f"model.moe_router must be softmax, deepseek_v2 or deepseek_v3, got {cfg.moe_router!r}")
    if cfg.moe_router != "softmax" and not cfg.n_experts:
        raise ValueError(f"model.moe_router={cfg.moe_router} routes experts, but model.n_experts is 0 (a dense model)")
    groups, top = cfg.moe_groups, cfg.moe_topk_groups
    if groups < 0 or top < 0 or (groups and (cfg.n_experts % groups or not 1 <= top <= groups
                                               or cfg.n_experts_per_token > top * cfg.n_experts // groups)):
        raise ValueError(f"model.moe_groups ({groups}) must divide model.n_experts ({cfg.n_experts}) and "
                         f"model.moe_topk_groups ({top}) be 1..moe_groups with room for "
                         f"{cfg.n_experts_per_token} experts a token (0 and 0: no groups)")
    if not (math.isfinite(cfg.routed_scaling) and cfg.routed_scaling > 0):
        raise ValueError(f"model.routed_scaling must be a finite number > 0, got {cfg.routed_scaling!r}")
