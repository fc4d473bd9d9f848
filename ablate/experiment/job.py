"""One job: compose arms, run the experiment, store the results, log to W&B, print the report.

No Hydra here: the CLI hands over the resolved config as a plain dict.
"""
from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ablate.checkpoints.loader import load_model
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.experiment.ablation import ARMS_TABLE
from ablate.experiment.config import RunConfig, to_run_config
from ablate.experiment.plan import make_plan
from ablate.experiment.run import ExperimentResult, run_experiment
from ablate.measure import device as dev
from ablate.measure import hardware
from ablate.model.llama import LlamaModel
from ablate.report.ablation import wandb_extras
from ablate.report.declared import FILE as DECLARATIONS_FILE
from ablate.report.page import summary_table, write_report
from ablate.report.wandb_log import log_run, summary_metrics
from ablate.results import RunFolder, environment

# keys that change where or how results are written, not what is measured
NOT_MEASURED = ("wandb", "redo", "results_dir")


def run_job(raw: dict[str, Any], registry: Registry, swallow_errors: bool = False) -> RunFolder | None:
    cfg = to_run_config(raw, registry)
    plan = make_plan(cfg, registry)               # incompatible plugins are refused here, before loading
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = dev.resolve(cfg.device)
    measured = {k: v for k, v in raw.items() if k not in NOT_MEASURED}
    folder = RunFolder.for_config(Path(cfg.results_dir), cfg.experiment.name, measured)
    if folder.is_done and not cfg.redo:
        print(f"already finished, skipped (redo=true runs it again): {folder.path}")
        return folder
    folder.start(raw, environment(dev.describe(device)), redo=cfg.redo)
    print(f"results: {folder.path}")
    if plan.ablation_arms is not None:    # every planned arm, measured or skipped with the reason, for the report
        folder.write_table(ARMS_TABLE, plan.ablation_arms)
        for row in plan.ablation_arms[plan.ablation_arms["status"] == "skipped"].itertuples():
            print(f"ablation: arm {row.arm} ({row.roles}) skipped: {row.reason}")
    try:
        if cfg.experiment.kind == "costs":    # analytic only (ch07): no model is loaded, no engine runs
            from ablate.experiment.costs_job import run_costs_job
            run_costs_job(cfg, raw, folder)
            return folder
        with dev.exclusive(device):
            result = _run(cfg, plan.arms, registry, device)
    except Exception as err:
        folder.finish("failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        if swallow_errors:   # a sweep goes on; this job is recorded as failed
            print(f"job failed, recorded in {folder.path / 'failed.json'}: {type(err).__name__}: {err}")
            return None
        raise
    _store(cfg, raw, plan.arms, result, folder)
    return folder


def _run(cfg: RunConfig, arms: list[Arm], registry: Registry, device: torch.device) -> ExperimentResult:
    peaks = hardware.peaks(device, cfg.model.torch_dtype, cfg.peak_bandwidth, cfg.peak_flops)
    print(f"peaks ({peaks.source}): bandwidth {peaks.bandwidth_bytes_s / 1e9:.1f} GB/s, "
          f"matmul {peaks.flops / 1e9:.1f} GFLOP/s ({cfg.model.dtype})")

    def loader(overrides: dict[str, Any]) -> LlamaModel:
        return load_model(replace(cfg.model, **overrides), device)

    return run_experiment(cfg.experiment, arms, loader, cfg.workload, cfg.engine, registry, peaks)


def _store(cfg: RunConfig, raw: dict[str, Any], arms: list[Arm], result: ExperimentResult,
           folder: RunFolder) -> None:
    point_keys = list(cfg.experiment.grid)
    folder.write_table("runs", result.runs)
    folder.write_table("requests", result.requests)
    folder.write_table("summary", result.summary)
    folder.write_text(DECLARATIONS_FILE, result.declared.to_json())
    notes = ["arms: " + "; ".join(f"{a.name} = {a.label()}" for a in arms),
             f"model {cfg.model.name} ({cfg.model.dtype}), {cfg.workload.num_requests} requests, "
             f"prompt {cfg.workload.prompt_len}, output {cfg.workload.output_len}, "
             f"{cfg.experiment.repeats} repeats after {cfg.experiment.warmup} warm-up",
             "speedup = baseline time / arm time per round, median [bootstrap 95% CI]; "
             "predicted = the analytic roofline's ratio"]
    report, figures = write_report(folder.path, result.summary, point_keys, cfg.experiment.name, notes,
                                   result.runs, result.declared)
    print()
    print(summary_table(result.summary, point_keys).to_string(index=False))
    if result.samples:
        print(f"\n{_sample_text(cfg, *next(iter(result.samples.items())))}")
    tags = [cfg.experiment.chapter, cfg.model.name] + [a.label() for a in arms]
    ablation_summary, ablation_tables = wandb_extras(folder.path)    # nothing unless an ablation
    wandb_dir = log_run(cfg.wandb, name=f"{cfg.experiment.name}-{folder.path.name}", group=cfg.experiment.name,
                        tags=tags, config=raw, summary=summary_metrics(result.summary, point_keys) | ablation_summary,
                        tables={"summary": result.summary, "runs": result.runs, **ablation_tables},
                        images=figures, default_dir=folder.path)
    folder.finish("done", wandb_dir=wandb_dir)
    print(f"\nreport: {report}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))


def _sample_text(cfg: RunConfig, arm: str, tokens: list[int]) -> str:
    """The first request's output: text for a real checkpoint, token ids for random weights."""
    if cfg.model.init != "pretrained":
        return f"sample ({arm}, random weights, first request's output token ids): {tokens[:24]}"
    from ablate.checkpoints.loader import load_tokenizer
    return f"sample ({arm}, first request's output):\n    {load_tokenizer(cfg.model).decode(tokens)!r}"
