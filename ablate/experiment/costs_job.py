"""A job of experiment.kind=costs (chapter 7): the cost calculator's tables, stored and logged like
an experiment's. No model is loaded."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ablate.analysis.costs import PUBLISHED_PARAMS, CostsConfig, cost_tables, printed_table, resolve_devices
from ablate.experiment.config import RunConfig
from ablate.report.table_run import store_tables
from ablate.results import RunFolder


def run_costs_job(cfg: RunConfig, raw: dict[str, Any], folder: RunFolder) -> None:
    """`python -m ablate +experiment=ch07_costs`: compute, print, store like any experiment, log to W&B."""
    config = cfg.costs or CostsConfig()
    devices = resolve_devices(config, cfg.peak_bandwidth, cfg.peak_flops)
    tables = cost_tables(config, devices)
    tables["device_specs"] = pd.DataFrame([{"device": k, **vars(d)} for k, d in devices.items()])
    table = printed_table(tables, config)
    print(table.to_string(index=False))
    notes = [f"dtype {config.dtype}; decode figures at batch 1 and context {config.context_lens[0]}",
             "memory left for KV = device memory - weight bytes (nothing kept for activations or the runtime)",
             "MFU ceiling = decode FLOPs per token / (its bandwidth lower bound on time) / peak FLOP/s",
             *[f"{k}: {d.source}" for k, d in devices.items()],
             *[f"{k}: {p.source}" for k, p in PUBLISHED_PARAMS.items()]]
    report = "\n".join([f"# {cfg.experiment.name}: serving costs from shapes and datasheets", "",
                        table.to_markdown(index=False), "", *[f"- {n}" for n in notes]]) + "\n"
    c0 = config.context_lens[0]
    summary = {f"kv_bytes_per_token/{r.model}": float(r.kv_bytes_per_token) for r in tables["models"].itertuples()}
    summary |= {f"decode_ms_per_token_at_{c0}/{r['model']}/{r['device']}": float(r[f"decode_ms_per_token_at_{c0}"])
                for _, r in tables["devices"].iterrows()}
    wandb_dir = store_tables(folder, experiment=cfg.experiment.name, chapter=cfg.experiment.chapter, config=raw,
                             tables=tables, report=report, summary=summary, wandb=cfg.wandb,
                             tags=[m.get("label") or m["preset"] for m in config.models])
    print(f"\nreport: {folder.path / 'report.md'}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))
