"""Chapter 13's second table: per arm, the KV bytes a token takes in the cache the arm ran, beside
the formula for the arm's model and beside what multi-head attention would cache.

    kv_bytes_per_token       the arm's cache, from the model it ran (its variant applied): the K/V
                             widths the model writes, checked against the cache's spec on every
                             run's first layer (ablate.model.forward)
    kv_bytes_predicted       the formula for the arm's model, from the run's config alone:
                             MHA/GQA 2 L H_kv d_h e;  MLA L (d_c + d_R) e
    kv_bytes_mha_equivalent  L H (d_qk + d_v) e: K and V cached per query head (MLA: K = [k^C, k^R]
                             of d_h + d_R, V of d_v; MHA/GQA: d_h each), the model before its variant
    vs_mha_equivalent        kv_bytes_per_token / kv_bytes_mha_equivalent
    token_slots_reserved     kv_reserved_peak_bytes (the bytes of the cache's tensors, numel x element
                             size) / kv_bytes_per_token: the tokens its buffers held room for

The arm's model is the run's model config with the arm's model fields on top (a Hugging Face
checkpoint directory's config.json when the timed weights are pretrained); a variant=gqa arm has
its kv_heads, a variant=mla arm its rank + 2 x rope_frequencies x K/V heads (both given). An arm
whose shape cannot be rebuilt has no prediction.
"""
from __future__ import annotations

import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pandas as pd

from ablate.model.config import DTYPES, ModelConfig

HEADING = "KV bytes per token: measured vs predicted"


def arm_model(config: dict[str, Any], spec: Any) -> ModelConfig | None:
    """The arm's model shape before its variant, or None when it cannot be rebuilt from the config."""
    model = dict(config.get("model") or {})
    model |= (spec or {}).get("model") or {} if isinstance(spec, dict) else {}
    if model.get("init") == "pretrained" and model.get("path") and Path(model["path"]).is_dir():
        from ablate.checkpoints.hf import hf_model_fields
        try:
            checkpoint, _ = hf_model_fields(model["path"])
        except ValueError:
            return None
        model |= {k: v for k, v in checkpoint.items() if k != "max_seq_len"}
    known = {f.name for f in fields(ModelConfig)}
    try:        # the shape only: no weights are read, whatever init and path say
        return ModelConfig(**{k: v for k, v in model.items() if k in known}
                           | {"init": "random", "path": None, "package": None, "dtype": "fp32"})
    except (TypeError, ValueError):
        return None


def mha_equivalent_kv_bytes(cfg: ModelConfig, element_bytes: int) -> int:
    """L H (d_qk + d_v) e: K and V cached for every query head, at the widths attention uses them."""
    qk = cfg.head_dim + (cfg.rope_head_dim if cfg.attention_kind == "mla" else 0)
    return cfg.n_layers * cfg.n_heads * (qk + cfg.value_head_dim) * element_bytes


def predicted(cfg: ModelConfig, variant: dict[str, Any], element_bytes: int) -> tuple[float, str]:
    """(KV bytes per token of the arm's model after its variant, its layout in words)."""
    name = variant.get("name", "none")
    if name == "gqa":
        cfg = replace(cfg, n_kv_heads=int(variant["kv_heads"]))
    elif name == "mla":          # ablate_variants.mla: d_c = rank, d_R = 2 f per K/V head
        rank, pairs = int(variant.get("rank", 0)), int(variant.get("rope_frequencies", 0))
        if not (rank and pairs):
            return math.nan, "mla (full rank or every pair: widths not in the config)"
        rope = 2 * pairs * cfg.n_kv_heads
        return float(cfg.n_layers * (rank + rope) * element_bytes), f"mla: latent {rank} + rotary {rope}"
    elif name != "none":
        return math.nan, name
    if cfg.attention_kind == "mla":
        layout = f"mla: latent {cfg.kv_latent_dim} + rotary {cfg.rope_head_dim}"
    else:
        layout = f"{cfg.n_kv_heads} K/V heads of {cfg.head_dim}"
    return float(cfg.kv_bytes_per_token(element_bytes)), layout


def _variant(spec: Any) -> dict[str, Any]:
    variant = (spec or {}).get("variant", "none") if isinstance(spec, dict) else "none"
    return dict(variant) if isinstance(variant, dict) else {"name": str(variant or "none")}


def analytic_tables(config: dict[str, Any], summary: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """{HEADING: one row per grid point and arm}; {} before a summary with the arms' bytes exists."""
    if summary is None or summary.empty or not {"kv_bytes_per_token", "dtype"} <= set(summary.columns):
        return {}
    exp = config.get("experiment") or {}
    specs = exp.get("arms") or {}
    points = [k for k in (exp.get("grid") or {}) if k in summary]
    rows = []
    for _, row in summary.iterrows():
        spec = specs.get(row["arm"])
        cfg = arm_model(config, spec)
        element_bytes = DTYPES[row["dtype"]].itemsize if row["dtype"] in DTYPES else 0
        if cfg is None or not element_bytes:
            bytes_predicted, layout, mha = math.nan, "", math.nan
        else:
            bytes_predicted, layout = predicted(cfg, _variant(spec), element_bytes)
            mha = float(mha_equivalent_kv_bytes(cfg, element_bytes))
        measured = row["kv_bytes_per_token"]
        rows.append({**{k: row[k] for k in points}, "arm": row["arm"], "kv_layout": layout,
                     "kv_bytes_per_token": measured, "kv_bytes_predicted": bytes_predicted,
                     "measured_vs_predicted": measured / bytes_predicted,
                     "kv_bytes_mha_equivalent": mha, "vs_mha_equivalent": measured / mha,
                     "token_slots_reserved": row.get("kv_reserved_peak_bytes", math.nan) / measured,
                     "seqs_admitted_max": row.get("seqs_admitted_max", math.nan)})
    return {HEADING: pd.DataFrame(rows).round(4)}
