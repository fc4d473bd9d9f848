"""Results of a job that computes its tables directly (the cost calculator, the micro-benchmarks).

Stored like an experiment's: results/<experiment>/<config hash>/ with config.json, environment.json,
one CSV per table, report.md and done.json, and logged to W&B as one run (offline by default; a
W&B failure never fails the job).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ablate.measure import device as dev
from ablate.report.wandb_log import WandbConfig, log_run
from ablate.results import RunFolder, environment


def open_run_folder(results_dir: str | Path, experiment: str, config: dict[str, Any],
                    device: torch.device) -> RunFolder:
    """A fresh run folder for this config; a finished one of the same config is moved aside, never overwritten."""
    folder = RunFolder.for_config(Path(results_dir), experiment, config)
    folder.start(config, environment(dev.describe(device)), redo=folder.path.exists())
    return folder


def store_tables(folder: RunFolder, *, experiment: str, chapter: str, config: dict[str, Any],
                 tables: dict[str, pd.DataFrame], report: str, summary: dict[str, float],
                 wandb: WandbConfig, tags: list[str] | None = None,
                 images: dict[str, Path] | None = None) -> str | None:
    """Write the tables and the report, log one W&B run (with the figures already written to
    `images`, tagged with `chapter`, the config's experiment.chapter, and `tags`), mark the folder
    done; returns the W&B run directory."""
    for name, frame in tables.items():
        folder.write_table(name, frame)
    folder.write_text("report.md", report)
    wandb_dir = log_run(wandb, name=f"{experiment}-{folder.path.name}", group=experiment,
                        tags=[chapter, *(tags or [])], config=config, summary=summary, tables=tables,
                        images=images or {}, default_dir=folder.path)
    folder.finish("done", wandb_dir=wandb_dir)
    return wandb_dir
