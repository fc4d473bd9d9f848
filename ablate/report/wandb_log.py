"""Weights & Biases: one run per job, offline by default; a W&B failure never fails a benchmark.

config = the resolved config (plus the hardware peaks and the environment when given), group = the
experiment, tags = experiment.chapter, the model and the arms, summary = per arm: speedups, memory,
latency percentiles, goodput (every SLO; the TTFT SLO alone) and quality, history = the per-arm
metrics of each round (x axis `round`), tables = the per-arm rows and the requests. A failed job is
logged too, with exit code 1 and its error. wandb is imported only here and only when logging is on,
so the engine runs where it is not installed; its own chatter (banner, sync hints) is silenced, our
warnings are one line each.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ablate.report.console import warning

MODES = ("offline", "online", "disabled")
LATENCY_KEYS = tuple(f"{m}_{p}_ms" for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p90", "p99"))
# summary keys per arm (and grid point), whichever of these columns the results hold
SUMMARY_KEYS = ("speedup", "speedup_ci_low", "speedup_ci_high", "predicted_speedup", "memory_ratio",
                "output_throughput_tok_s", "peak_memory_bytes", "kv_reserved_peak_bytes", *LATENCY_KEYS,
                "goodput_req_s", "goodput_ttft_req_s", "ttft_slo_attained", "ppl_ratio", "token_agreement",
                "time_ratio", "time_ratio_ci_low", "time_ratio_ci_high", "contended_rounds")
TEXT_KEYS = ("status", "status_detail", "quality_flag")   # status_detail: why an arm has no speedup, one line
# history: one step per round, these metrics per arm (and grid point)
ROUND_KEYS = ("duration_s", "output_throughput_tok_s", *LATENCY_KEYS, "goodput_req_s", "goodput_ttft_req_s",
              "ttft_slo_attained", "peak_memory_bytes", "ppl_ratio", "token_agreement",
              # what the CPU was doing (ablate.measure.cpu_load): contended is 1 for a round left out
              "cpu_time_share", "cpu_others_cores", "cpu_steal_share", "cpu_wait_share", "cpu_left_share",
              "involuntary_switches", "load_1m", "contended")
MAX_TABLE_ROWS = 100_000    # a W&B table beyond this is refused; the results folder has every row


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


def _suffix(row: pd.Series, point_keys: list[str]) -> str:
    return "".join(f"/{k}={row[k]}" for k in point_keys if k in row)


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def summary_metrics(summary: pd.DataFrame, point_keys: list[str]) -> dict[str, float | str]:
    """Flat keys `<column>/<arm>[/<key>=<value>...]`: SUMMARY_KEYS as numbers, TEXT_KEYS as text."""
    out: dict[str, float | str] = {}
    try:
        for _, row in summary.iterrows():
            suffix = _suffix(row, point_keys)
            for key in SUMMARY_KEYS:
                if key in row and (value := _number(row[key])) is not None:
                    out[f"{key}/{row['arm']}{suffix}"] = value
            for key in TEXT_KEYS:
                if key in row and isinstance(row[key], str) and row[key]:
                    out[f"{key}/{row['arm']}{suffix}"] = row[key]
    except Exception as err:     # a frame of an unexpected shape: log what there is, never fail
        warn(f"W&B summary incomplete ({_reason(err)})")
    return out


def round_metrics(runs: pd.DataFrame | None, point_keys: list[str]) -> list[dict[str, float]]:
    """One dict per round (`repeat` column), `round` plus ROUND_KEYS per arm and grid point."""
    if runs is None or runs.empty or "repeat" not in runs or "arm" not in runs:
        return []
    steps = []
    for repeat, rows in runs.groupby("repeat", sort=True):
        step: dict[str, float] = {"round": int(repeat)}
        for _, row in rows.iterrows():
            suffix = _suffix(row, point_keys)
            for key in ROUND_KEYS:
                if key in row and (value := _number(row[key])) is not None:
                    step[f"{key}/{row['arm']}{suffix}"] = value
        steps.append(step)
    return steps


def _safe_tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", text)[:64]


def warn(message: str) -> None:
    """One line on stderr, however long or multi-line the error behind it (wandb's often are)."""
    warning(message)


def _reason(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:160]}"


def _with_context(config: dict[str, Any], peaks: dict[str, Any] | None,
                  environment: dict[str, Any] | None) -> dict[str, Any]:
    extra = {k: v for k, v in (("peaks", peaks), ("environment", environment)) if v}
    return {**config, **extra}


def _start(settings: WandbConfig, default_dir: Path, init: dict[str, Any]) -> Any:
    """wandb.init, silenced; online falls back to offline. The run, or None after one warning."""
    if settings.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        warn("W&B logging skipped: wandb is not installed (pip install wandb); the results folder has everything")
        return None
    try:
        directory = Path(settings.dir or default_dir)
        directory.mkdir(parents=True, exist_ok=True)
        tags = [_safe_tag(str(t)) for t in init.pop("tags", None) or [] if t]
        init = dict(project=settings.project, entity=settings.entity, dir=str(directory), reinit="finish_previous",
                    tags=tags, **init)
        quiet = dict(silent=True, console="off", x_disable_stats=True)
    except Exception as err:
        warn(f"W&B logging skipped ({_reason(err)}); the results folder has everything")
        return None
    try:
        return wandb.init(mode=settings.mode, settings=wandb.Settings(init_timeout=settings.init_timeout, **quiet),
                          **init)
    except Exception as err:   # unreachable or misconfigured: fall back to offline, never fail
        if settings.mode == "offline":
            warn(f"W&B offline logging failed ({_reason(err)}); the results folder has everything")
            return None
        try:
            run = wandb.init(mode="offline", settings=wandb.Settings(**quiet), **init)
        except Exception as err2:
            warn(f"W&B {settings.mode} logging failed ({_reason(err)}), and offline too ({_reason(err2)}); "
                 "the results folder has everything")
            return None
        warn(f"W&B {settings.mode} logging failed ({_reason(err)}); logged offline instead to "
             f"{os.path.dirname(run.dir)} (upload it later with `wandb sync <that folder>`)")
        return run


def _abandon(run: Any, err: BaseException) -> None:
    warn(f"W&B logging failed while writing ({_reason(err)}); the results folder has everything")
    try:
        run.finish(exit_code=1)
    except Exception:
        pass


def log_run(settings: WandbConfig, *, name: str, group: str, tags: list[str], config: dict[str, Any],
            summary: dict[str, float | str], tables: dict[str, pd.DataFrame], images: dict[str, Path],
            default_dir: Path, runs: pd.DataFrame | None = None, point_keys: list[str] | None = None,
            peaks: dict[str, Any] | None = None, environment: dict[str, Any] | None = None) -> str | None:
    """Log one job; returns the local run directory, or None when logging is off or failed.

    `runs` (one row per grid point x arm x round) adds a history step per round; `peaks` and
    `environment` go into the config. Nothing here raises: wandb missing, no API key, a server
    that cannot be reached, a bad entity or project all end in one warning line, and (for online)
    a run logged offline instead."""
    try:
        steps = round_metrics(runs, point_keys or [])
    except Exception as err:
        warn(f"W&B per-round metrics skipped ({_reason(err)})")
        steps = []
    run = _start(settings, default_dir, dict(group=group, name=name, tags=tags,
                                             config=_with_context(config, peaks, environment)))
    if run is None:
        return None
    try:
        import wandb

        if steps:
            run.define_metric("round")
            for key in {k.split("/")[0] for step in steps for k in step if k != "round"}:
                run.define_metric(f"{key}/*", step_metric="round")
            for step in steps:
                run.log(step)
        run.summary.update(summary)
        run.log({name: wandb.Table(dataframe=frame.head(MAX_TABLE_ROWS)) for name, frame in tables.items()
                 if frame is not None and not frame.empty}
                | {name: wandb.Image(str(path)) for name, path in images.items() if Path(path).exists()})
        run_dir = os.path.dirname(run.dir)
        run.finish()
        return run_dir
    except Exception as err:
        _abandon(run, err)
        return None


def log_failed_run(settings: WandbConfig, *, name: str, group: str, tags: list[str], config: dict[str, Any],
                   error: str, default_dir: Path, peaks: dict[str, Any] | None = None,
                   environment: dict[str, Any] | None = None) -> str | None:
    """Log a job that failed as a W&B run with exit code 1 and `error` in its summary (status
    "failed"), so that a sweep's failures show beside its results. Never raises."""
    run = _start(settings, default_dir, dict(group=group, name=name, tags=[*tags, "failed"],
                                             config=_with_context(config, peaks, environment)))
    if run is None:
        return None
    try:
        run.summary.update({"status": "failed", "error": " ".join(str(error).split())[:2000]})
        run_dir = os.path.dirname(run.dir)
        run.finish(exit_code=1)
        return run_dir
    except Exception as err:
        _abandon(run, err)
        return None
