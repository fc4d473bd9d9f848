"""variant=gqa: fewer K/V heads, by mean-pooling a checkpoint's K and V projections within each group.

Query head q of a model with H query heads and G K/V heads reads K/V head q // (H / G). Going from
G to G' heads (G' divides G) merges the m = G / G' consecutive heads j m .. (j + 1) m - 1 into head
j, which is what every query head that read one of them now reads:

    W_K'[j] = (1 / m) sum_{i < m} W_K[j m + i]      (the same for W_V and the biases)

(Ainslie et al. 2023, "GQA", section 2.1: mean-pooling is the conversion they found best before
uptraining; we do not uptrain, so the quality cost is measured as is). G' = 1 is MQA; G' = G is
the model unchanged. Pooling runs in fp32 in a fixed order, so it is deterministic.

More heads than the model has (G' a multiple of G dividing H) repeats each head G' / G times: the
same model, exactly, with G' / G times the KV bytes (e.g. SmolLM2's 3 K/V heads made 9: its MHA form,
the reference its GQA and MQA forms are compared with).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ablate.api import BuildContext, ModelVariant, PluginConfig, QualityBound, Stat
from ablate.api.model import LlamaModel, ModelConfig, SelfAttention
from ablate_variants.rebuild import with_new_attention


@dataclass
class GQAConfig(PluginConfig):
    name: str = "gqa"
    kv_heads: int = 1      # K/V heads after: a divisor of the model's (pooled; 1: MQA) or a multiple (repeated)

    def __post_init__(self) -> None:
        if self.kv_heads < 1:
            raise ValueError(f"variant.kv_heads must be >= 1, got {self.kv_heads}")


def mean_pool_heads(rows: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """(num_heads x head_dim, ...) per-head rows -> (num_groups x head_dim, ...): consecutive heads averaged."""
    per_head = rows.shape[0] // num_heads
    grouped = rows.float().view(num_groups, num_heads // num_groups, per_head, *rows.shape[1:])   # (G', m, D, ...)
    return grouped.mean(dim=1).reshape(num_groups * per_head, *rows.shape[1:]).to(rows.dtype)     # (G' D, ...)


def repeat_heads(rows: torch.Tensor, num_heads: int, num_new: int) -> torch.Tensor:
    """(num_heads x head_dim, ...) -> (num_new x head_dim, ...): each head repeated num_new / num_heads times."""
    per_head = rows.shape[0] // num_heads
    per_head_rows = rows.view(num_heads, per_head, *rows.shape[1:])                              # (G, D, ...)
    return per_head_rows.repeat_interleave(num_new // num_heads, dim=0).reshape(num_new * per_head, *rows.shape[1:])


def regroup_heads(rows: torch.Tensor, num_heads: int, num_new: int) -> torch.Tensor:
    """Fewer heads: mean-pool consecutive ones; more: repeat each."""
    if num_new <= num_heads:
        return mean_pool_heads(rows, num_heads, num_new)
    return repeat_heads(rows, num_heads, num_new)


def pooled_attention(old: SelfAttention, cfg: ModelConfig, layer: int) -> SelfAttention:
    """A SelfAttention of shape `cfg` from `old`: W_Q kept, W_K and W_V regrouped, W_O shared."""
    with torch.device("meta"):                 # no time spent on an initialisation that is overwritten
        new = SelfAttention(cfg, layer)
    new = new.to_empty(device=old.wqkv.weight.device).to(old.wqkv.weight.dtype)
    with torch.no_grad():
        for param_name in ("weight", "bias"):
            old_param: nn.Parameter | None = getattr(old.wqkv, param_name)
            if old_param is None:
                continue
            q, k, v = old_param.split((old.q_size, old.kv_size, old.kv_size), dim=0)   # rows of W_Q, W_K, W_V
            k = regroup_heads(k, old.n_kv_heads, cfg.n_kv_heads)                       # (G' D, d)
            v = regroup_heads(v, old.n_kv_heads, cfg.n_kv_heads)
            getattr(new.wqkv, param_name).copy_(torch.cat((q, k, v)))
    new.wo = old.wo
    return new


def kv_heads_refusal(cfg: ModelConfig, kv_heads: int) -> str | None:
    """Why a model of this shape cannot be given `kv_heads` K/V heads, or None."""
    if cfg.attention_kind != "mha":
        return (f"variant=gqa converts per-head K/V projections (model.attention_kind=mha); model "
                f"{cfg.name!r} uses attention_kind={cfg.attention_kind}, whose K/V heads it cannot pool: "
                "run it with variant=none")
    if cfg.qk_norm:
        return (f"variant=gqa pools K projections, and model {cfg.name!r} normalises each K head after "
                "its projection (qk_norm, Qwen3): pooled projections would meet a norm fitted to "
                "unpooled ones; run it with variant=none")
    if cfg.n_kv_heads % kv_heads and (kv_heads % cfg.n_kv_heads or cfg.n_heads % kv_heads):
        return (f"variant.kv_heads={kv_heads} must divide model {cfg.name!r}'s {cfg.n_kv_heads} K/V heads, "
                f"or be a multiple of them that divides its {cfg.n_heads} query heads")
    return None


def to_kv_heads(model: LlamaModel, kv_heads: int) -> LlamaModel:
    """The model with `kv_heads` K/V heads; the model itself (not a copy) when it already has them."""
    cfg = model.config
    why = kv_heads_refusal(cfg, kv_heads)
    if why:
        raise ValueError(why)
    if kv_heads == cfg.n_kv_heads:
        return model
    new_cfg = replace(cfg, n_kv_heads=kv_heads)
    return with_new_attention(model, new_cfg, lambda i, old: pooled_attention(old, new_cfg, i))


class GroupedKVHeads(ModelVariant):
    name = "gqa"
    config_class = GQAConfig
    exact = False                      # pooled K/V change the model's outputs
    # the kit's check, on the tiny random model at kv_heads=1 (its 2 K/V heads pooled): ratio 1.76
    # measured; random heads are unrelated, so pooling costs more there than in a trained model
    quality = QualityBound(max_ratio=2.0, num_tokens=96)
    reported_stats = (Stat("kv_heads_before", "K/V heads of the loaded model", "count"),
                      Stat("kv_heads_after", "K/V heads the arm runs", "count", table="Model variant"))

    def __init__(self, config: GQAConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self._heads = (0, 0)

    @classmethod
    def refusal(cls, config: GQAConfig, model: ModelConfig) -> str | None:
        return kv_heads_refusal(model, config.kv_heads)

    def apply(self, model: LlamaModel) -> LlamaModel:
        converted = to_kv_heads(model, self.config.kv_heads)
        self._heads = (model.config.n_kv_heads, converted.config.n_kv_heads)
        return converted

    def stats(self) -> dict[str, float]:
        return {"kv_heads_before": self._heads[0], "kv_heads_after": self._heads[1]}
