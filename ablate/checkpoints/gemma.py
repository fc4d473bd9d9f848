"""Gemma 2 and Gemma 3 (text) checkpoints: what their config.json turns on, and their weights as
ablate's layers take them.

Gemma is a Llama-family decoder with: embeddings x sqrt(hidden_size); RMSNorms that scale by
(1 + w) rather than w; four norms per layer (on the attention's and the MLP's inputs and outputs);
a GeGLU MLP (GELU, tanh approximation); scores scaled by 1/sqrt(query_pre_attn_scalar) rather than
1/sqrt(head_dim); windowed and full layers (layer_types, read by ablate.checkpoints.hf); tied
embeddings. Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 normalises each
head's q and k (as Qwen3) and gives its windowed layers a RoPE base of their own.

Two of these are folded into the weights as they are read (GemmaWeights), so that ablate's RMSNorm
and attention serve unchanged: each norm's stored w becomes 1 + w, and the queries are scaled by
sqrt(head_dim / query_pre_attn_scalar) (Gemma 2: q_proj's rows; Gemma 3: q_norm's weight, since its
norm would undo a scaled projection), so that the attention's 1/sqrt(head_dim) gives Gemma's scale.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
GELU_TANH = "gelu_pytorch_tanh"     # transformers' name of GELU's tanh approximation
# the fields gemma_fields sets, as every other checkpoint has them (a preset's never stay)
NO_GEMMA = dict(scale_embeddings=False, post_norms=False, mlp_activation="silu", attn_softcap=0.0, final_softcap=0.0,
                rope_local_base=0.0, rope_linear_factor=1.0)


class GemmaConfigError(ValueError):
    """A Gemma config.json that asks for something ablate does not run (a CheckpointError in hf.py)."""


def gemma_fields(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The ModelConfig fields a Gemma config.json sets beyond the Llama family's (windows: hf.py)."""
    model_type = config["model_type"]
    act = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise GemmaConfigError(f"{directory}: hidden_activation {act!r} is not supported for {model_type} "
                               f"({GELU_TANH} only)")
    if config.get("use_bidirectional_attention"):
        raise GemmaConfigError(f"{directory}: use_bidirectional_attention=true is not supported (causal attention only)")
    fields: dict[str, Any] = dict(
        scale_embeddings=True, post_norms=True, mlp_activation="gelu_tanh",
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        qk_norm=model_type == "gemma3_text",
    )
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0):
        raise GemmaConfigError(f"{directory}: query_pre_attn_scalar must be a number > 0, got {scalar!r}")
    if model_type == "gemma3_text":
        fields |= _gemma3_rope(config, directory)
    return fields


def _gemma3_rope(config: dict[str, Any], directory: Path) -> dict[str, float]:
    """Gemma 3's RoPE per kind of layer: transformers 5 writes rope_parameters per layer type (full
    layers 1M, sliding 10k by default, the full ones optionally scaled linearly), older versions
    rope_theta, rope_local_base_freq and rope_scaling."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = dict(config.get("rope_scaling") or {}, rope_theta=config.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear") or (rope_type == "linear" and kind == "sliding_attention"):
            raise GemmaConfigError(f"{directory}: RoPE scaling {rope_type!r} of the {kind} layers is not supported "
                                   "(the full layers: default or linear; the sliding layers: default)")
    factor = float(full.get("factor", 1.0)) if full.get("rope_type", full.get("type")) == "linear" else 1.0
    return dict(rope_base=float(full.get("rope_theta", 1_000_000.0)),
                rope_local_base=float(local.get("rope_theta", 10_000.0)), rope_linear_factor=factor)


class GemmaWeights(Mapping[str, torch.Tensor]):
    """A Gemma checkpoint's tensors as ablate's layers take them (names unchanged, read when looked up):
    every RMSNorm weight w as 1 + w, and the queries scaled by sqrt(head_dim / query_pre_attn_scalar)
    (Gemma 2's q_proj rows, Gemma 3's q_norm weight)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], model_type: str, head_dim: int,
                 query_pre_attn_scalar: float) -> None:
        self._weights = weights
        self._scale = math.sqrt(head_dim / query_pre_attn_scalar)
        self._scaled = "q_norm.weight" if model_type == "gemma3_text" else "q_proj.weight"

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._weights[name]
        if name.endswith("norm.weight"):      # x (1 + w): in fp32, as Gemma's norm computes it
            tensor = 1.0 + tensor.float()
        if name.endswith(self._scaled) and self._scale != 1.0:
            tensor = tensor.float() * self._scale
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def close(self) -> None:
        close = getattr(self._weights, "close", None)
        if close is not None:
            close()
