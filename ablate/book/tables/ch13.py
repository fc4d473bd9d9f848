"""Chapter 13's table: per arm (KV variant), the KV bytes one token takes beside the perplexity that
variant costs, from the run's summary (nothing is measured again, so a report redrawn from the run
folder shows the same figures).

    kv_bytes_ratio       kv_bytes_per_token / the unconverted arm's
    perplexity           of held-out text through the arm (ablate.experiment.quality_guard), on the
                         weights experiment.quality.weights names (`perplexity_on` says which)
    ppl_vs_unconverted   perplexity / the unconverted arm's

The unconverted arm is the one whose model variant is `none` (the model as shipped); without one,
the baseline arm. When the summary has no perplexity (quality guard off, or the pretrained
checkpoint not installed) the table is one line saying why.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

HEADING = "KV bytes per token vs perplexity"


def _variant(spec: Any) -> str:
    """An arm spec's model variant name ('none' when it sets none)."""
    variant = (spec or {}).get("variant", "none") if isinstance(spec, dict) else "none"
    return variant.get("name", "none") if isinstance(variant, dict) else str(variant or "none")


def _variant_text(spec: Any) -> str:
    """'gqa kv_heads=9', 'mla rank=128 ...' or 'none': the arm's variant and its options."""
    variant = (spec or {}).get("variant", "none") if isinstance(spec, dict) else "none"
    if not isinstance(variant, dict):
        return str(variant or "none")
    return " ".join([str(variant.get("name", "none")), *(f"{k}={v}" for k, v in variant.items() if k != "name")])


def _unconverted(config: dict[str, Any], arms: list[str]) -> str:
    exp = config.get("experiment") or {}
    specs = exp.get("arms") or {}
    plain = [a for a in arms if _variant(specs.get(a)) == "none"]
    return plain[0] if plain else (exp.get("baseline") or arms[0])


def _weights(config: dict[str, Any]) -> str:
    """Which weights the perplexity comes from, in a few words."""
    model = config.get("model") or {}
    quality = (config.get("experiment") or {}).get("quality") or {}
    source = model.get("path") or model.get("package") or "no checkpoint"
    if quality.get("weights", "timed") == "pretrained" and model.get("init") != "pretrained":
        return f"pretrained {source}, converted per arm (timed on {model.get('init', 'random')} weights)"
    return f"the timed weights ({model.get('init', '?')}, {source})"


def _why_none(config: dict[str, Any]) -> str:
    quality = (config.get("experiment") or {}).get("quality") or {}
    if not quality.get("enabled", True):
        return "no perplexity: the quality guard is off (experiment.quality.enabled=false)"
    if quality.get("weights", "timed") == "pretrained":
        from ablate.checkpoints.loader import CheckpointNotFound, checkpoint_path
        from ablate.model.config import ModelConfig
        model = config.get("model") or {}
        try:
            checkpoint_path(ModelConfig(name=model.get("name", ""), path=model.get("path") or None,
                                        package=model.get("package") or None))
        except CheckpointNotFound as err:
            return f"no perplexity: the pretrained checkpoint is missing ({err})"
    return "no perplexity was recorded (the baseline arm failed, or the run predates the quality guard)"


def analytic_tables(config: dict[str, Any], summary: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """{HEADING: one row per grid point and arm}, or a one-line table saying why there is no perplexity."""
    if summary is None or summary.empty:
        return {}
    if "perplexity" not in summary or summary["perplexity"].isna().all():
        return {HEADING: pd.DataFrame({"note": [_why_none(config)]})}
    exp = config.get("experiment") or {}
    points = [k for k in (exp.get("grid") or {}) if k in summary]
    frames = []
    for _, frame in summary.groupby(points, sort=False) if points else [((), summary)]:
        base = frame.set_index("arm").loc[_unconverted(config, frame["arm"].tolist())]
        out = frame[[*points, "arm", "kv_bytes_per_token", "perplexity", "ppl_ratio", "status"]].copy()
        specs = exp.get("arms") or {}
        out.insert(out.columns.get_loc("arm") + 1, "variant", [_variant_text(specs.get(a)) for a in out["arm"]])
        out.insert(out.columns.get_loc("kv_bytes_per_token") + 1, "kv_bytes_ratio",
                   out["kv_bytes_per_token"] / base["kv_bytes_per_token"])
        out.insert(out.columns.get_loc("ppl_ratio") + 1, "ppl_vs_unconverted", out["perplexity"] / base["perplexity"])
        frames.append(out)
    table = pd.concat(frames, ignore_index=True).rename(columns={"ppl_ratio": "ppl_vs_baseline"})
    return {HEADING: table.assign(perplexity_on=_weights(config)).round(4)}
