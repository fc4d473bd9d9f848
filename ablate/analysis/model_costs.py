"""A model shape's serving figures per token, in one dtype: the cost calculator's model side.

For a model with L layers, H query heads of width d_h, H_kv K/V heads, in a dtype of e bytes:

    KV bytes per token       kv = 2 L H_kv d_h e              (MLA: L (d_c + d_R) e)
    weight bytes             W = params e                      (MoE: every expert is held)
    active weight bytes      W_active = params_active e        (the weights a decoded token reads:
                                                                all but the embedding table, of which
                                                                it reads one row; MoE: of each MoE
                                                                layer's routed experts the k it reaches)
    decode FLOPs per token   2 params_active + 4 L H d_h c     (matmuls; Q K^T and P V over c keys;
                                                                MLA absorbed: 2 L H (2 d_c + d_R) c)
    decode bytes per token   W_active + c kv                   (batch 1: weights and the context's KV
                                                                read once)

A ModelConfig with experts counts them itself (ModelConfig.num_params(active=True)); a preset whose
mixture of experts it does not express takes the published total and active counts (PUBLISHED_PARAMS).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ablate.model.config import DTYPES, ModelConfig
from ablate.model.presets import preset


@dataclass(frozen=True)
class PublishedParams:
    """Parameter counts a ModelConfig cannot express (mixture-of-experts MLPs)."""

    total: float                # every parameter (all experts): what memory holds
    active: float               # parameters one token uses (shared + routed experts): what decode reads
    source: str


PUBLISHED_PARAMS: dict[str, PublishedParams] = {
    "deepseek-v2": PublishedParams(236e9, 21e9, "DeepSeek-V2 paper (arXiv:2405.04434): 236B total, 21B activated "
                                                "per token"),
}


@dataclass(frozen=True)
class ModelCosts:
    """A model shape's per-token figures in one dtype."""

    label: str
    cfg: ModelConfig
    element_bytes: int
    params_total: float
    params_active: float            # parameters whose weights a decoded token reads (matmuls)
    kv_bytes_per_token: int

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.element_bytes

    @property
    def active_weight_bytes(self) -> float:
        return self.params_active * self.element_bytes

    @property
    def kv_heads(self) -> int:
        """K/V heads a token caches per layer (MLA: 1, the latent row every query head reads)."""
        return self.cfg.kv_cache_widths[0]

    def attention_flops_per_token(self, context: int) -> float:
        """Q K^T and P V of one query over `context` keys, every layer and head."""
        cfg = self.cfg
        if cfg.attention_kind == "mla":   # absorbed: scores over d_c + d_R, outputs over d_c
            return 2 * cfg.n_layers * cfg.n_heads * (2 * cfg.kv_latent_dim + cfg.rope_head_dim) * context
        return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context

    def decode_flops_per_token(self, context: int) -> float:
        return 2 * self.params_active + self.attention_flops_per_token(context)

    def kv_bytes_at(self, context: int) -> int:
        """K/V bytes one sequence of `context` tokens needs: context x kv_bytes_per_token, but a layer
        with a sliding window needs its last window tokens only (ModelConfig.kv_bytes_at)."""
        return self.cfg.kv_bytes_at(context, self.element_bytes)

    def decode_bytes_per_token(self, context: int) -> float:
        return self.active_weight_bytes + self.kv_bytes_at(context)


ENTRY_KEYS = ("preset", "label", "weights_of")


def model_costs(entry: dict[str, Any], dtype: str) -> ModelCosts:
    """entry: {"preset": name, "label": optional, **ModelConfig fields to change}, and optionally
    "weights_of": a preset whose unchanged shape gives the parameter counts (the KV and attention
    keep the changed shape). The book's LLaMA-2-70B "before GQA" is {preset: llama-2-70b,
    n_kv_heads: 64, weights_of: llama-2-70b}: 64 K/V heads cached beside the real model's ~140 GB
    of weights (a true 64-head model would hold 157 GB: its K and V projections are 8x wider)."""
    fields = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    cfg = preset(entry["preset"], dtype=dtype, **fields)
    label = entry.get("label") or entry["preset"]
    element_bytes = DTYPES[dtype].itemsize
    weights_of = entry.get("weights_of") or entry["preset"]
    shape = preset(weights_of, dtype=dtype) if entry.get("weights_of") else cfg
    published = PUBLISHED_PARAMS.get(weights_of)
    if published is not None:
        total, active = published.total, published.active
    else:
        total = shape.num_params()
        # a decoded token reads every matmul weight (of a mixture of experts, the router, the shared
        # expert and the k routed experts it reaches); of the embedding table only its own row (untied)
        active = shape.num_params(active=True) - (0 if shape.tied_embeddings else shape.vocab_size * shape.d_model)
    return ModelCosts(label, cfg, element_bytes, float(total), float(active), cfg.kv_bytes_per_token(element_bytes))
