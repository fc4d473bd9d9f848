"""Weights & Biases: one run per job, offline by default; a W&B failure never fails a benchmark.

config = the resolved config, group = the experiment, tags = chapter and plugins, summary = the
speedups and memory ratios, tables = the per-arm rows. wandb is imported only here and only when
logging is on, so the engine runs where wandb is not installed.
"""
from __future__ import annotations

import os
import re
import sys
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
    init_timeout: float = 30.0     # seconds wandb.init may wait for the server before offline takes over

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"wandb.mode must be one of {MODES}, got {self.mode!r}")
        if self.init_timeout <= 0:
            raise ValueError(f"wandb.init_timeout must be > 0 seconds, got {self.init_timeout}")


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


def warn(message: str) -> None:
    """One line on stderr, however long or multi-line the error behind it (wandb's often are)."""
    print(f"WARNING: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _reason(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:160]}"


def log_run(settings: WandbConfig, *, name: str, group: str, tags: list[str], config: dict[str, Any],
            summary: dict[str, float], tables: dict[str, pd.DataFrame], images: dict[str, Path],
            default_dir: Path) -> str | None:
    """Log one job; returns the local run directory, or None when logging is off or failed.

    Nothing here raises: wandb missing, no API key, a server that cannot be reached, a bad entity
    or project all end in one warning line, and (for online) a run logged offline instead."""
    if settings.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        warn("W&B logging skipped: wandb is not installed (pip install wandb); the results folder has everything")
        return None
    directory = Path(settings.dir or default_dir)
    directory.mkdir(parents=True, exist_ok=True)
    init = dict(project=settings.project, entity=settings.entity, group=group, name=name, dir=str(directory),
                tags=[_safe_tag(t) for t in tags if t], config=config, reinit="finish_previous")
    try:
        run = wandb.init(mode=settings.mode, settings=wandb.Settings(init_timeout=settings.init_timeout), **init)
    except Exception as err:   # unreachable or misconfigured: fall back to offline, never fail
        if settings.mode == "offline":
            warn(f"W&B offline logging failed ({_reason(err)}); the results folder has everything")
            return None
        try:
            run = wandb.init(mode="offline", **init)
        except Exception as err2:
            warn(f"W&B {settings.mode} logging failed ({_reason(err)}), and offline too ({_reason(err2)}); "
                 "the results folder has everything")
            return None
        warn(f"W&B {settings.mode} logging failed ({_reason(err)}); logged offline instead to "
             f"{os.path.dirname(run.dir)} (upload it later with `wandb sync <that folder>`)")
    try:
        run.summary.update(summary)
        run.log({name: wandb.Table(dataframe=frame) for name, frame in tables.items() if not frame.empty}
                | {name: wandb.Image(str(path)) for name, path in images.items() if Path(path).exists()})
        run_dir = os.path.dirname(run.dir)
        run.finish()
        return run_dir
    except Exception as err:
        warn(f"W&B logging failed while writing ({_reason(err)}); the results folder has everything")
        try:
            run.finish(exit_code=1)
        except Exception:
            pass
        return None
