"""A job of experiment.kind=costs: the cost calculator's tables, stored and logged like
an experiment's. No model is loaded."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ablate.analysis.costs import PUBLISHED_PARAMS, CostsConfig, cost_tables, printed_intensity_table, printed_table
from ablate.analysis.intensity import TRAINING_FLOPS_PER_PARAM, TRAINING_WEIGHT_READS
from ablate.experiment.config import RunConfig
from ablate.measure.cost_devices import resolve_devices
from ablate.report.table_run import store_tables
from ablate.results import RunFolder


def _report(name: str, table: pd.DataFrame, notes: list[str], intensity: pd.DataFrame,
            intensity_notes: list[str]) -> str:
    return "\n".join([f"# {name}: serving costs from shapes and datasheets", "",
                      table.to_markdown(index=False), "", *[f"- {n}" for n in notes], "",
                      "## Training vs inference: arithmetic intensity and the MFU ceiling", "",
                      intensity.to_markdown(index=False), "", *[f"- {n}" for n in intensity_notes]]) + "\n"


def run_costs_job(cfg: RunConfig, raw: dict[str, Any], folder: RunFolder) -> None:
    """A costs job (experiment.kind=costs): compute, print, store like any experiment, log to W&B."""
    config = cfg.costs or CostsConfig()
    devices = resolve_devices(config, cfg.peak_bandwidth, cfg.peak_flops)
    tables = cost_tables(config, devices)
    tables["device_specs"] = pd.DataFrame([{"device": k, "num_devices": s.num_devices, **vars(s.device)}
                                           for k, s in devices.items()])
    table, intensity = printed_table(tables, config), printed_intensity_table(tables)
    print(table.to_string(index=False))
    print("\ntraining vs inference: arithmetic intensity FLOP/byte (MFU ceiling); bw = bandwidth-bound")
    print(intensity.to_string(index=False))
    c0 = config.context_lens[0]
    notes = [f"dtype {config.dtype}; decode figures at batch 1 and context {c0}",
             "memory left for KV = device memory - weight bytes (nothing kept for activations or the runtime)",
             "MFU ceiling = decode FLOPs per token / (its bandwidth lower bound on time) / peak FLOP/s",
             "<N>x<device>: tensor parallel over N devices (weights and K/V heads split N ways; GB/device = "
             "weights per device; KV copies > 1 when a model has fewer K/V heads than devices; KV/token in "
             "all, copies included); ms/token is a lower bound: no communication is counted",
             *[f"{k}: {s.device.source}" for k, s in devices.items() if s.num_devices == 1],
             *[f"{k}: {p.source}" for k, p in PUBLISHED_PARAMS.items()]]
    intensity_notes = [
        "cell: arithmetic intensity in FLOP/byte per device (MFU ceiling = min(1, intensity / ridge)); "
        "bw: below the ridge F/B, bandwidth-bound; otherwise compute-bound",
        f"decode b: b sequences each emit a token at context {c0}: FLOPs b (2 N_active + attention), bytes "
        "the active weights once + each sequence's KV",
        f"train b: b tokens a step, forward + backward: {TRAINING_FLOPS_PER_PARAM} N_active FLOPs a token, "
        f"weights read {TRAINING_WEIGHT_READS} times a step (activations, gradients and optimizer state not "
        "counted; b sequences of s tokens would be b s tokens, so these are floors)",
        "formulas: ablate/analysis/intensity.py"]
    report = _report(cfg.experiment.name, table, notes, intensity, intensity_notes)
    summary = {f"kv_bytes_per_token/{r.model}": float(r.kv_bytes_per_token) for r in tables["models"].itertuples()}
    summary |= {f"decode_ms_per_token_at_{c0}/{r['model']}/{r['device']}": float(r[f"decode_ms_per_token_at_{c0}"])
                for _, r in tables["devices"].iterrows()}
    wandb_dir = store_tables(folder, experiment=cfg.experiment.name, chapter=cfg.experiment.chapter, config=raw,
                             tables=tables, report=report, summary=summary, wandb=cfg.wandb,
                             tags=[m.get("label") or m["preset"] for m in config.models])
    print(f"\nreport: {folder.path / 'report.md'}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))
