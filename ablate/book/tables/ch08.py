"""Chapter 8's table: one row per grid point, the recomputation arithmetic of
ablate.analysis.recompute (token positions fed, FLOPs with a cache and without) for the run's model,
prompt and output lengths, beside the ratios a ch08_kv_cache run measured (recompute arm over
contiguous arm).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pandas as pd

from ablate.analysis.recompute import (flops_with_cache, flops_without_cache, positions_with_cache,
                                       positions_without_cache, prefill_flops)
from ablate.model.config import ModelConfig
from ablate.model.presets import PRESETS, preset

TABLE_HEADING = "Recompute arithmetic (predicted beside measured)"
NO_CACHE_ARM, CACHED_ARM = "recompute", "contiguous"      # ch08_kv_cache's arms (by name or by kv_cache)


def _model_config(model: dict[str, Any] | ModelConfig) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in (model or {}).items() if k in names}
    return preset(fields.pop("name"), **fields) if fields.get("name") in PRESETS else ModelConfig(**fields)


def _arm_names(experiment: dict[str, Any]) -> tuple[str, str]:
    """(no-cache arm, contiguous-cache arm): by their kv_cache, else ch08's names."""
    def cache_of(spec: Any) -> Any:
        value = (spec or {}).get("kv_cache") if isinstance(spec, dict) else None
        return value.get("name") if isinstance(value, dict) else value
    arms = experiment.get("arms") or {}
    by_cache = {cache_of(spec): name for name, spec in reversed(list(arms.items()))}
    return by_cache.get("none", NO_CACHE_ARM), by_cache.get("contiguous", CACHED_ARM)


def _measured(summary: pd.DataFrame | None, point: dict[str, Any], arm: str, column: str) -> float:
    """The summary's `column` of `arm` at this grid point; NaN when absent or not ok."""
    if summary is None or column not in summary or "arm" not in summary:
        return math.nan
    rows = summary[summary["arm"] == arm]
    for key, value in point.items():
        if key not in rows:
            return math.nan
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        rows = rows[pd.to_numeric(rows[key], errors="coerce") == value if numeric else rows[key].astype(str) == str(value)]
    if "status" in rows:
        rows = rows[rows["status"] == "ok"]
    return float(rows[column].iloc[0]) if len(rows) and pd.notna(rows[column].iloc[0]) else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def analytic_tables(config: dict[str, Any], summary: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """{TABLE_HEADING: one row per grid point}: token positions and FLOPs ratios predicted for the
    run's model, prompt and output lengths, beside the recompute/contiguous ratios measured (median
    duration; TPOT against the decode passes' FLOPs ratio) and the recompute arm's growth from the
    previous output length (previous prompt length when the grid has no output_len)."""
    cfg = _model_config(config.get("model") or {})
    experiment, workload = config.get("experiment") or {}, config.get("workload") or {}
    grid: dict[str, list] = experiment.get("grid") or {}
    none_arm, cached_arm = _arm_names(experiment)
    axis = next((k for k in ("output_len", "prompt_len") if k in grid), None)
    rows, previous = [], {}
    for values in itertools.product(*grid.values()) if grid else [()]:
        point = dict(zip(grid, values))
        p = int(point.get("prompt_len", workload.get("prompt_len", 1)))
        n = int(point.get("output_len", workload.get("output_len", 1)))
        none, cached, pre = flops_without_cache(cfg, n, p), flops_with_cache(cfg, n, p), prefill_flops(cfg, p)
        time_none = _measured(summary, point, none_arm, "duration_s")
        row = {**{k: v for k, v in point.items() if k not in ("prompt_len", "output_len")},
               "prompt": p, "output": n,
               "positions no cache": positions_without_cache(n, p), "positions cached": positions_with_cache(n, p),
               "attention share no cache": round(none.attention / none.total, 4),
               "FLOPs ratio (pred)": round(none.total / cached.total, 2),
               "time ratio (meas)": round(_ratio(time_none, _measured(summary, point, cached_arm, "duration_s")), 2),
               "decode FLOPs ratio (pred)": round(_ratio(none.total - pre.total, cached.total - pre.total), 2),
               "TPOT ratio (meas)": round(_ratio(_measured(summary, point, none_arm, "tpot_p50_ms"),
                                                 _measured(summary, point, cached_arm, "tpot_p50_ms")), 2)}
        if axis is not None:
            key = tuple((k, v) for k, v in point.items() if k != axis)
            before = previous.get(key)
            row["no-cache growth (pred)"] = round(none.total / before[0], 2) if before else math.nan
            row["no-cache growth (meas)"] = round(_ratio(time_none, before[1]), 2) if before else math.nan
            previous[key] = (none.total, time_none)
        rows.append(row)
    return {TABLE_HEADING: pd.DataFrame(rows)}
