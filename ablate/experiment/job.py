"""One job: compose arms, run the experiment, store the results, log to W&B, print the report.

No Hydra here: the CLI hands over the resolved config as a plain dict.
"""
from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ablate.measure import device as dev
from ablate.measure import hardware
from ablate.checkpoints.loader import load_model
from ablate.experiment.ablation import ARMS_TABLE, plan_arms, plan_table
from ablate.report.ablation import wandb_extras
from ablate.engine.arm import BASELINE, Arm, baseline_configs, resolve_arm
from ablate.experiment.config import RunConfig, to_run_config
from ablate.experiment.run import ExperimentResult, run_experiment
from ablate.model.llama import LlamaModel
from ablate.api.plugin import PluginConfig, Slot
from ablate.engine.registry import Registry
from ablate.report.page import summary_table, write_report
from ablate.results import RunFolder, environment
from ablate.report.wandb_log import log_run, summary_metrics

# keys that change where or how results are written, not what is measured
NOT_MEASURED = ("wandb", "redo", "results_dir")


def make_arms(cfg: RunConfig, plugins: dict[Slot, PluginConfig], registry: Registry) -> list[Arm]:
    """The experiment's arms over the composed slots; with none given: the baseline vs the composition."""
    if cfg.experiment.ablation:    # techniques -> arms (ablate/ablation.py); skipped ones are not arms
        return plan_arms(cfg.experiment.ablation, plugins, registry)[0]
    if cfg.experiment.arms:
        return [resolve_arm(name, spec, plugins, registry) for name, spec in cfg.experiment.arms.items()]
    baseline = resolve_arm("baseline", {}, baseline_configs(registry), registry)
    composed = resolve_arm("variant", {}, plugins, registry)
    if all(c.name == BASELINE[s] for s, c in plugins.items()):
        return [baseline]
    composed.name = composed.label().replace(" ", ",")
    return [baseline, composed]


def run_job(raw: dict[str, Any], registry: Registry, swallow_errors: bool = False) -> RunFolder | None:
    cfg, plugins = to_run_config(raw, registry)
    arms = make_arms(cfg, plugins, registry)      # incompatible plugins are refused here, before loading
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
    if cfg.experiment.ablation:    # every planned arm, measured or skipped with the reason, for the report
        plan = plan_table(cfg.experiment.ablation, plugins, registry)
        folder.write_table(ARMS_TABLE, plan)
        for row in plan[plan["status"] == "skipped"].itertuples():
            print(f"ablation: arm {row.arm} ({row.roles}) skipped: {row.reason}")
    try:
        if cfg.experiment.kind == "costs":    # analytic only (ch07): no model is loaded, no engine runs
            from ablate.analysis.costs import run_costs_job
            run_costs_job(cfg, raw, folder)
            return folder
        with dev.exclusive(device):
            result = _run(cfg, arms, registry, device)
    except Exception as err:
        folder.finish("failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        if swallow_errors:   # a sweep goes on; this job is recorded as failed
            print(f"job failed, recorded in {folder.path / 'failed.json'}: {type(err).__name__}: {err}")
            return None
        raise
    _store(cfg, raw, arms, result, folder)
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
    notes = ["arms: " + "; ".join(f"{a.name} = {a.label()}" for a in arms),
             f"model {cfg.model.name} ({cfg.model.dtype}), {cfg.workload.num_requests} requests, "
             f"prompt {cfg.workload.prompt_len}, output {cfg.workload.output_len}, "
             f"{cfg.experiment.repeats} repeats after {cfg.experiment.warmup} warm-up",
             "speedup = baseline time / arm time per round, median [bootstrap 95% CI]; "
             "predicted = the analytic roofline's ratio"]
    report, figures = write_report(folder.path, result.summary, point_keys, cfg.experiment.name, notes,
                                   result.runs)
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
