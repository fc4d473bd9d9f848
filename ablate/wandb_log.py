"""Weights & Biases: one run per job, offline by default; a W&B failure never fails a benchmark.

config = the resolved config, group = the experiment, tags = chapter and plugins, summary = the
speedups and memory ratios, tables = the per-arm rows. wandb is imported only here and only when
logging is on, so the engine runs where wandb is not installed.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

MODES = ("offline", "online", "disabled")


@dataclass
class WandbConfig:
    mode: str = "offline"          # offline (sync later with `wandb sync`) | online | disabled
    project: str = "ablate"
    entity: str | None = None
    dir: str | None = None         # where offline runs are written; default: the results folder

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"wandb.mode must be one of {MODES}, got {self.mode!r}")


def summary_metrics(summary: pd.DataFrame, point_keys: list[str]) -> dict[str, float]:
    """Flat keys: speedup/<arm>[/<point>], memory_ratio/<arm>..., throughput/<arm>..."""
    out: dict[str, float] = {}
    for _, row in summary.iterrows():
        suffix = "".join(f"/{k}={row[k]}" for k in point_keys)
        for key in ("speedup", "speedup_ci_low", "speedup_ci_high", "predicted_speedup", "memory_ratio",
                    "output_throughput_tok_s", "peak_memory_bytes", "kv_reserved_peak_bytes"):
            if key in row and pd.notna(row[key]):
                out[f"{key}/{row['arm']}{suffix}"] = float(row[key])
    return out


def _safe_tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", text)[:64]


def log_run(settings: WandbConfig, *, name: str, group: str, tags: list[str], config: dict[str, Any],
            summary: dict[str, float], tables: dict[str, pd.DataFrame], images: dict[str, Path],
            default_dir: Path) -> str | None:
    """Log one job; returns the local run directory, or None when logging is off or failed."""
    if settings.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        warnings.warn("wandb is not installed: results are in the results folder only", stacklevel=2)
        return None
    directory = Path(settings.dir or default_dir)
    directory.mkdir(parents=True, exist_ok=True)
    init = dict(project=settings.project, entity=settings.entity, group=group, name=name, dir=str(directory),
                tags=[_safe_tag(t) for t in tags if t], config=config, reinit="finish_previous")
    try:
        run = wandb.init(mode=settings.mode, **init)
    except Exception as err:   # unreachable or misconfigured: fall back to offline, never fail
        if settings.mode == "offline":
            warnings.warn(f"W&B logging failed ({err}); results are in the results folder only", stacklevel=2)
            return None
        warnings.warn(f"W&B {settings.mode} logging failed ({err}); logging offline instead", stacklevel=2)
        try:
            run = wandb.init(mode="offline", **init)
        except Exception as err2:
            warnings.warn(f"W&B offline logging failed too ({err2})", stacklevel=2)
            return None
    try:
        run.summary.update(summary)
        run.log({name: wandb.Table(dataframe=frame) for name, frame in tables.items() if not frame.empty}
                | {name: wandb.Image(str(path)) for name, path in images.items() if Path(path).exists()})
        run_dir = os.path.dirname(run.dir)
        run.finish()
        return run_dir
    except Exception as err:
        warnings.warn(f"W&B logging failed while writing ({err}); results are in the results folder", stacklevel=2)
        try:
            run.finish(exit_code=1)
        except Exception:
            pass
        return None
