"""DeepSeek-V2/V3 checkpoints (model_type deepseek_v2, deepseek_v3): multi-head latent attention.

What config.json gives (ablate/model/mla.py has the maths):

    kv_lora_rank -> kv_latent_dim (d_c)       qk_nope_head_dim -> head_dim (d_h)
    qk_rope_head_dim -> rope_head_dim (d_R)   v_head_dim -> v_head_dim (d_v)
    q_lora_rank -> q_lora_rank (d_c'; null: a full q_proj, as V2-Lite)
    rope_parameters / rope_scaling: default, or yarn -> rope_yarn_scaling (inverse frequencies, the
    attention factor on cos and sin, and mscale_all_dim's mscale^2 on the score scale)

DeepSeek rotates interleaved pairs (dims 2i and 2i + 1 at frequency w_i): transformers' V2 always
(a complex product), V3 when rope_interleave (the default). ablate rotates halves (dims i and
i + d_R / 2), so the rotary rows of q_proj / q_b_proj and kv_a_proj_with_mqa are permuted as they
are read, evens first then odds, as llama.cpp's converter does: q^R . k^R is the same sum over pairs
in either order, and the cached k^R is in the permuted order throughout.

The layers from first_k_dense_replace on are mixtures of experts with DeepSeek's routing
(ablate/model/deepseek_moe.py). Refused, by name: other RoPE scalings, YaRN without a truncated
correction range, moe_layer_freq other than 1, V2's norm_topk_prob (transformers ignores it) and
topk methods other than greedy and group_limited_greedy (hf.py refuses attention_bias).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# the MLA fields of every other checkpoint: whatever the preset it is loaded over says, it has none
NO_MLA = dict(attention_kind="mha", kv_latent_dim=0, rope_head_dim=0, v_head_dim=0, q_lora_rank=0, latent_norms=False,
              rope_yarn_scaling=None)
_MLA_WIDTHS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _error(message: str) -> Exception:
    from ablate.checkpoints.hf import CheckpointError    # hf.py imports this module
    return CheckpointError(message)


def deepseek_fields(config: dict[str, Any], directory: str | os.PathLike) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2/V3 config.json beyond the Llama-family ones hf.py reads."""
    path = Path(directory) / "config.json"
    for key in _MLA_WIDTHS:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _error(f"{path}: {key} must be a whole number > 0, got {value!r}")
    q_rank = config.get("q_lora_rank")
    if q_rank is not None and (isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank <= 0):
        raise _error(f"{path}: q_lora_rank must be null (a full q_proj) or a whole number > 0, got {q_rank!r}")
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != config["num_attention_heads"]:   # transformers would repeat K/V heads
        raise _error(f"{path}: num_key_value_heads ({kv_heads}) must equal num_attention_heads "
                     f"({config['num_attention_heads']}): MLA up-projects a K and a V for every query head from the latent")
    if config["qk_rope_head_dim"] % 2:
        raise _error(f"{path}: qk_rope_head_dim must be even (RoPE rotates pairs), got {config['qk_rope_head_dim']}")
    theta, yarn = _rope(config, path)
    return _experts(config, path) | dict(
        attention_kind="mla",
        n_kv_heads=int(config["num_attention_heads"]),      # every query head has its own K and V from c
        head_dim=int(config["qk_nope_head_dim"]),
        kv_latent_dim=int(config["kv_lora_rank"]),
        rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        q_lora_rank=int(q_rank or 0),
        latent_norms=True,
        rope_base=theta,
        rope_yarn_scaling=yarn,
    )


def _whole(config: dict[str, Any], path: Path, key: str, low: int = 1) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _error(f"{path}: {key} must be a whole number >= {low}, got {value!r}")
    return value


def _experts(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The mixture of experts of layers first_k_dense_replace.. (ablate/model/deepseek_moe.py), as
    transformers 5 builds it: V2 softmax scores, top-k greedy or within groups (topk_method); V3
    sigmoid scores with e_score_correction_bias, within groups, norm_topk_prob; both scaled by
    routed_scaling_factor, with n_shared_experts x moe_intermediate_size of shared SwiGLU."""
    layers, model_type = int(config["num_hidden_layers"]), config["model_type"]
    dense = _whole(config, path, "first_k_dense_replace", low=0) if "first_k_dense_replace" in config else 0
    if dense >= layers:
        return {}
    if config.get("moe_layer_freq", 1) not in (1, None):
        raise _error(f"{path}: moe_layer_freq={config['moe_layer_freq']} is not supported (1: every layer from "
                     "first_k_dense_replace on is a mixture of experts, as transformers builds it)")
    experts, top_k = _whole(config, path, "n_routed_experts"), _whole(config, path, "num_experts_per_tok")
    groups = topk_groups = 0
    v3 = model_type == "deepseek_v3"
    method = config.get("topk_method") or "greedy"
    if v3 or method == "group_limited_greedy":
        groups, topk_groups = _whole(config, path, "n_group"), _whole(config, path, "topk_group")
    elif method != "greedy":
        raise _error(f"{path}: topk_method {method!r} is not supported for deepseek_v2 (greedy or group_limited_greedy)")
    normalise = config.get("norm_topk_prob", False)
    if not isinstance(normalise, bool) or (normalise and not v3):
        raise _error(f"{path}: norm_topk_prob={normalise!r} is not supported for {model_type} (transformers' "
                     "DeepSeek-V2 never renormalises; V3 reads true or false)")
    scale = config.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise _error(f"{path}: routed_scaling_factor must be a number > 0, got {scale!r}")
    width = _whole(config, path, "moe_intermediate_size")
    shared = _whole(config, path, "n_shared_experts", low=0) if config.get("n_shared_experts") is not None else 0
    return dict(n_experts=experts, n_experts_per_token=top_k, expert_d_ff=width, shared_expert_d_ff=shared * width,
                norm_topk_prob=normalise, dense_layers=list(range(dense)) or None,
                moe_router=model_type, moe_groups=groups, moe_topk_groups=topk_groups, routed_scaling=float(scale))


def rope_is_interleaved(config: dict[str, Any]) -> bool:
    """Whether the checkpoint's rotary rows are interleaved pairs (transformers' DeepseekV2 always is)."""
    return config["model_type"] == "deepseek_v2" or bool(config.get("rope_interleave", True))


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's (and transformers') yarn_get_mscale: 0.1 mscale ln(factor) + 1, for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(config: dict[str, Any], path: Path) -> tuple[float, dict[str, float] | None]:
    """(theta, model.rope_yarn_scaling or None), resolved as transformers 5 resolves them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta", params.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise _error(f"{path}: RoPE scaling {rope_type!r} is not supported for {config['model_type']} "
                     "(only 'yarn', or none)")
    if params.get("truncate", True) is not True:
        raise _error(f"{path}: yarn RoPE with truncate=false is not supported (only the truncated correction range)")
    context = float(params.get("original_max_position_embeddings") or config.get("max_position_embeddings", 0))
    factor = params.get("factor") or config.get("max_position_embeddings", 0) / context
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:        # transformers' _compute_yarn_parameters
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor, 1.0))
    # transformers' yarn_apply_mscale: the softmax scale times mscale(factor, mscale_all_dim)^2
    softmax_mscale = _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    yarn = {"factor": factor, "original_max_position_embeddings": context,
            "beta_fast": params.get("beta_fast") or 32, "beta_slow": params.get("beta_slow") or 1,
            "attention_factor": attention_factor, "softmax_mscale": softmax_mscale}
    bad = {k: v for k, v in yarn.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0}
    if bad:
        raise _error(f"{path}: yarn RoPE needs positive numbers, got {bad}")
    return theta, {k: float(v) for k, v in yarn.items()}


def half_split_order(width: int) -> torch.Tensor:
    """Row order that turns interleaved pairs (2i, 2i + 1) into halves (i, i + width / 2): evens, then odds."""
    return torch.cat((torch.arange(0, width, 2, device="cpu"), torch.arange(1, width, 2, device="cpu")))   # as read


class HalfSplitRope(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, with the rotary rows of each query and latent projection
    permuted from interleaved pairs to halves as they are read (one tensor at a time, as the mapping
    it wraps)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], n_heads: int, head_dim: int, rope_dim: int) -> None:
        self._weights = weights
        self._heads, self._head_dim, self._rope_dim = n_heads, head_dim, rope_dim
        self._order = half_split_order(rope_dim)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._weights[name]
        # a tensor of another shape is passed as it is: the loader's shape check names it
        if (name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"))
                and t.dim() == 2 and t.shape[0] == self._heads * (self._head_dim + self._rope_dim)):
            rows = t.view(self._heads, self._head_dim + self._rope_dim, -1)        # (H, d_h + d_R, in)
            rotary = rows[:, self._head_dim:][:, self._order]                      # (H, d_R, in), halves
            return torch.cat((rows[:, :self._head_dim], rotary), dim=1).view_as(t)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight") and t.dim() == 2 and t.shape[0] > self._rope_dim:
            latent = t.shape[0] - self._rope_dim                                   # rows: c (d_c), then k^R (d_R)
            return torch.cat((t[:latent], t[latent:][self._order]))
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
