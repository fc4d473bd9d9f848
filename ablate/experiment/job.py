"""One job: compose arms, run the experiment, store the results, log to W&B, print the report.

What is measured is kept first: every finished round is written to the run folder as it completes
(runs.csv, requests.csv), so a job killed or failed midway keeps its rounds, and running the same
config again measures only the rounds still missing, provided the same code measured them
(ablate.results.code_version; other code: the old rounds are set aside, not mixed in) and the same
weights, plugin packages and outside engines (ablate.experiment.identity: otherwise the earlier
run, finished or not, is set aside with what changed). After the measurement, the summary and
done.json are written before anything that may fail for reasons of its own (the report's figures,
the sample text, W&B): those are best effort, and a failure there is a warning recorded in done.json.

No Hydra here: the CLI hands over the resolved config as a plain dict.
"""
from __future__ import annotations

import hashlib
import json
import os
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ablate.api import tuning
from ablate.analysis.ablation_plan import ARMS_TABLE
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.experiment.baseline_failure import KEY as BASELINE_FAILED, baseline_failure
from ablate.experiment.config import RunConfig, to_run_config
from ablate.experiment.identity import KEY as IDENTITY_KEY, measured_inputs, recorded_inputs, what_changed
from ablate.experiment.plan import make_plan
from ablate.experiment.run import ExperimentResult, run_experiment
from ablate import process_env
from ablate.measure import cpu_policy, device as dev, hardware
from ablate.model.config import resolve_dtype
from ablate.model.llama import LlamaModel
from ablate.model.product_paths import PRODUCT_PATHS
from ablate.report.ablation import decode_modes, wandb_extras
from ablate.report.console import job_prefix, kept_warnings
from ablate.report.declared import FILE as DECLARATIONS_FILE
from ablate.book.chapter_tables import analytic_tables, table_name
from ablate.report.page import write_report
from ablate.report.console_table import console_table
from ablate.report.tables import summary_notes
from ablate.report.wandb_log import log_failed_run, log_run, summary_metrics, warn
from ablate.results import RunFolder, code_version, environment

# keys that change where or how results are written, not what is measured
NOT_MEASURED = ("wandb", "redo", "results_dir")
INPUT_FILES = ("trace_path", "dataset_path", "count_tokenizer")    # workload keys naming files it reads


def resolved_config(raw: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The composed config with what the device decides filled in (model.dtype=auto -> bf16 on CUDA,
    fp32 on the CPU): what config.json, W&B and the run id record."""
    model = raw.get("model")
    if not isinstance(model, dict) or "dtype" not in model:
        return raw
    return {**raw, "model": {**model, "dtype": resolve_dtype(str(model["dtype"]), device)}}


def run_identity(raw: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What a run's folder id hashes (RunFolder.for_config): the measured config, its dtype resolved,
    and the device it runs on (`cpu`, `cuda: NVIDIA H200`), so that a finished CPU run never makes
    the GPU job of the same config look finished (it would be skipped), nor the reverse."""
    measured = {k: v for k, v in resolved_config(raw, device).items() if k not in NOT_MEASURED}
    return measured | {"device_identity": dev.identity(device), "input_files": input_file_digests(raw)}


def input_file_digests(raw: dict[str, Any]) -> dict[str, str]:
    """A digest of each file the workload reads (trace, dataset, counting tokenizer): an edited file
    is a new run, not one already finished. A file that cannot be read is left to the workload's own
    check, which names it."""
    workload = raw.get("workload") or {}
    digests = {}
    for key in INPUT_FILES:
        path = workload.get(key)
        if path and Path(path).is_file():
            digests[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return digests


def run_job(raw: dict[str, Any], registry: Registry, swallow_errors: bool = False,
            job_dir: str | None = None) -> RunFolder | None:
    """Run one job; `job_dir` (Hydra's output folder of the job) gets a link to the run folder."""
    cfg = to_run_config(raw, registry)
    plan = make_plan(cfg, registry)               # incompatible plugins are refused here, before loading
    say = _printer(job_prefix())
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cpu_policy.threads_for_job(cfg.threads, threads_before))
    try:
        with PRODUCT_PATHS.forced(cfg.cpu_products):     # recorded with the choices (environment.json)
            return _job(cfg, raw, plan, registry, swallow_errors, job_dir, say)
    finally:
        torch.set_num_threads(threads_before)      # jobs of a sweep may share this process


def _job(cfg: RunConfig, raw: dict[str, Any], plan, registry: Registry, swallow_errors: bool,
         job_dir: str | None, say) -> RunFolder | None:
    device = dev.resolve(cfg.device)
    cfg = replace(cfg, model=cfg.model.for_device(device))
    dev.refuse_emulated_dtype(cfg.model.dtype, device)      # before a run folder is made for it
    raw = resolved_config(raw, device)
    folder = RunFolder.for_config(Path(cfg.results_dir), cfg.experiment.name, run_identity(raw, device))
    try:
        folder.path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(folder.path.parent, os.W_OK):
            raise PermissionError(f"no write permission on {folder.path.parent}")
    except OSError as err:
        raise ValueError(f"results_dir={cfg.results_dir}: run folders cannot be written there ({err}); "
                         "give a writable folder") from err
    with folder.lock(), kept_warnings() as given:     # for done.json and the report
        return _measure(cfg, raw, plan, registry, swallow_errors, job_dir, say, device, folder, given)


def _measure(cfg: RunConfig, raw: dict[str, Any], plan, registry: Registry, swallow_errors: bool,
             job_dir: str | None, say, device: torch.device, folder: RunFolder,
             given: list[str]) -> RunFolder | None:
    code = code_version()
    inputs = measured_inputs(cfg.model, plan.arms, registry)    # weights, plugin packages, outside engines
    if folder.path.exists() and not cfg.redo and (changed := what_changed(recorded_inputs(folder.path), inputs)):
        folder.set_aside(f"not reused: what it measured changed since ({changed})")
    if folder.is_done and not cfg.redo:
        say(f"already finished, skipped (redo=true runs it again): {folder.path}")
        if folder.code_version not in (None, code):
            warn(f"{folder.path} was measured by code {folder.code_version}, this is {code}: "
                 "its figures may not hold for this code; redo=true measures again")
        return folder
    done = None
    if folder.path.exists() and not cfg.redo:
        runs, requests = folder.measured_rounds()
        if not runs.empty and folder.code_version == code:
            done = (runs, requests)
            say(f"continuing an unfinished run: {runs['repeat'].nunique()} round(s) kept from {folder.path}")
        elif not runs.empty:
            folder.set_aside(f"rounds measured by other code ({folder.code_version}, now {code})")
    # before the peaks' probe and any arm: every arm's kv_cache.budget_fraction is of this one reading
    free_bytes = dev.free_memory_bytes(device)
    peaks = _peaks(cfg, device, say)
    env = environment(dev.describe(device) | {"free_memory_bytes_at_start": free_bytes}) | {
        "peaks": peaks.record() if peaks else None, IDENTITY_KEY: inputs, "process_env": process_env.record()}
    if device.type == "cpu":
        policy = cpu_policy.prepare()
        env["cpu_policy"] = policy.record() | {"threads": torch.get_num_threads()}
        say(f"CPU: {policy.machine}, {torch.get_num_threads()} threads, OpenMP waiting: {policy.wait_policy} "
            f"({policy.reason})")
    folder.start(raw, env, redo=cfg.redo)
    _link(job_dir, folder)
    say(f"results: {folder.path}")
    if plan.ablation_arms is not None:    # every planned arm, measured or skipped with the reason, for the report
        folder.write_table(ARMS_TABLE, plan.ablation_arms)
        for row in plan.ablation_arms[plan.ablation_arms["status"] == "skipped"].itertuples():
            say(f"ablation: arm {row.arm} ({row.roles}) skipped: {row.reason}")
    try:
        if cfg.experiment.kind == "costs":    # analytic only (ch07): no model is loaded, no engine runs
            from ablate.experiment.costs_job import run_costs_job
            run_costs_job(cfg, raw, folder)
            return folder
        if cfg.experiment.kind == "book":     # the chapter's claims: computed, measured briefly, or read from runs
            from ablate.experiment.book_job import run_book_job
            run_book_job(cfg, raw, folder, device)
            return folder

        def keep(runs, requests) -> None:   # after every round: what was measured is on disk
            folder.write_table("runs", runs)
            folder.write_table("requests", requests)

        def loader(overrides: dict[str, Any]) -> LlamaModel:
            return load_model(replace(cfg.model, **overrides), device)

        with dev.exclusive(device):
            result = run_experiment(cfg.experiment, plan.arms, loader, cfg.workload, cfg.engine, registry, peaks,
                                    progress=say, done=done, on_round=keep, kv_free_bytes=free_bytes)
        keep(result.runs, result.requests)
        env["linear_paths"] = PRODUCT_PATHS.choices()    # the CPU product paths of the run, recorded
        env["tuned"] = tuning.choices()                   # what plugins chose by timing (ablate.api.tuning)
        if device.type == "cpu":
            env["huge_pages"] = dev.huge_pages()
        folder.write_text("environment.json", json.dumps(env, indent=2, default=str))
        folder.write_table("summary", result.summary)
        folder.write_text(DECLARATIONS_FILE, result.declared.to_json())
    except (Exception, SystemExit) as err:       # SystemExit: a sys.exit outside the plugins' calls (theirs fail their arm)
        error = f"{type(err).__name__}: {err}"
        folder.finish("failed", error=error, traceback=traceback.format_exc())
        log_failed_run(cfg.wandb, name=f"{cfg.experiment.name}-{folder.path.name}", group=cfg.experiment.name,
                       tags=_tags(cfg, plan.arms), config=raw, error=error, default_dir=folder.path,
                       **_wandb_context(env))
        if swallow_errors:   # a sweep goes on; this job is recorded as failed
            say(f"job failed, recorded in {folder.path / 'failed.json'}: {error}")
            return None
        raise
    warnings, wandb_dir = _publish(cfg, raw, plan.arms, result, folder, env, say, given)
    failure = baseline_failure(result.summary, cfg.experiment.baseline or plan.arms[0].name)
    folder.finish("done", wandb_dir=wandb_dir, warnings=warnings, **({BASELINE_FAILED: failure} if failure else {}))
    return folder


def _peaks(cfg: RunConfig, device: torch.device, say) -> hardware.Peaks | None:
    """This machine's peaks (cached, measured, or given), or None with the reason printed."""
    if cfg.experiment.kind in ("costs", "book"):    # no engine run: nothing to divide by peaks
        return None
    try:
        peaks = hardware.peaks(device, cfg.model.torch_dtype, cfg.peak_bandwidth, cfg.peak_flops)
    except hardware.PeaksUnavailable as err:
        say(f"peaks: none, so MBU, MFU and the roofline prediction are left empty: {err}")
        return None
    say(f"peaks ({peaks.source}{', measured ' + peaks.measured_at if peaks.measured_at else ''}): bandwidth "
        f"{peaks.bandwidth_bytes_s / 1e9:.1f} GB/s, matmul {peaks.flops / 1e9:.1f} GFLOP/s "
        f"({cfg.model.dtype}, {peaks.threads} threads)")
    return peaks


def _publish(cfg: RunConfig, raw: dict[str, Any], arms: list[Arm], result: ExperimentResult, folder: RunFolder,
             env: dict[str, Any], say, given: list[str]) -> tuple[list[str], str | None]:
    """The report, the console table, the sample and W&B: each best effort; returns the summary's
    notes and every warning given (`given`: the job's so far, and what failed here), and the W&B
    run's folder."""
    point_keys = list(cfg.experiment.grid)

    def attempt(what: str, action) -> Any:
        try:
            return action()
        except Exception as err:          # warned, so kept in `given`
            warn(f"{what} failed ({type(err).__name__}: {err}); the measurements are in {folder.path}")
            return None

    notes = ["arms: " + "; ".join(f"{a.name} = {a.label()}" for a in arms),
             f"model {cfg.model.name} ({cfg.model.dtype}), {cfg.workload.num_requests} requests, "
             f"prompt {cfg.workload.prompt_len}, output {cfg.workload.output_len}, "
             f"{result.runs['repeat'].nunique()} rounds after {cfg.experiment.warmup} warm-up",
             "speedup = baseline time / arm time per round: geometric mean over rounds [t 95% CI on the "
             "log ratios; none under 3 rounds]; predicted = the analytic roofline's ratio",
             "quality: token agreement with the baseline's greedy text, and perplexity of held-out text "
             "through each arm / the baseline's; an arm beyond the limits is *degraded* and gets no speedup",
             decode_modes(result.runs)]
    notes = [n for n in notes if n] + [f"warning: {w}" for w in given]
    analytic = attempt("the analytic tables", lambda: analytic_tables(raw, result.summary)) or {}
    for heading, table in analytic.items():
        attempt(f"storing {heading!r}", lambda: folder.write_table(table_name(heading), table))
    written = attempt("the report", lambda: write_report(
        folder.path, result.summary, point_keys, cfg.experiment.name, notes, result.runs, result.declared,
        ttft_slo_ms=cfg.experiment.ttft_slo_ms, tpot_slo_ms=cfg.experiment.tpot_slo_ms, analytic=analytic))
    report, figures = written or (None, {})
    print()
    attempt("the console table", lambda: print(console_table(result.summary, point_keys)))
    if result.samples:
        attempt("the sample", lambda: print(f"\n{_sample_text(cfg, *next(iter(result.samples.items())))}"))
    ablation_summary, ablation_tables = attempt("the ablation's W&B extras", lambda: wandb_extras(folder.path)) or ({}, {})
    wandb_dir = log_run(cfg.wandb, name=f"{cfg.experiment.name}-{folder.path.name}", group=cfg.experiment.name,
                        tags=_tags(cfg, arms), config=raw,
                        summary=summary_metrics(result.summary, point_keys) | ablation_summary,
                        tables={"summary": result.summary, "runs": result.runs, "requests": result.requests,
                                **ablation_tables, **{table_name(h): t for h, t in analytic.items()}},
                        images=figures, default_dir=folder.path, runs=result.runs, point_keys=point_keys,
                        **_wandb_context(env))
    say(f"\nreport: {report}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))
    return summary_notes(result.summary, point_keys) + given, wandb_dir


def _wandb_context(env: dict[str, Any]) -> dict[str, Any]:
    """environment.json for the W&B config: its peaks at the top (config.peaks), the rest under environment."""
    return {"peaks": env["peaks"], "environment": {k: v for k, v in env.items() if k != "peaks"}}


def _tags(cfg: RunConfig, arms: list[Arm]) -> list[str]:
    return [cfg.experiment.chapter, cfg.model.name] + [a.label() for a in arms]


def _printer(prefix: str):
    """print, every line prefixed (a sweep's jobs say which job a line is from)."""
    def say(text: str) -> None:
        print("\n".join(prefix + line if line else line for line in str(text).split("\n")), flush=True)
    return say


def _link(job_dir: str | None, folder: RunFolder) -> None:
    """Hydra's job folder -> the run folder (a `results` link), and the run folder lists its job folders."""
    if not job_dir:
        return
    try:
        link = Path(job_dir) / "results"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(folder.path.resolve(), target_is_directory=True)
        with open(folder.path / "hydra_job_dirs.txt", "a") as f:
            f.write(f"{Path(job_dir).resolve()}\n")
    except OSError as err:
        warn(f"could not link Hydra's job folder {job_dir} to {folder.path}: {err}")


def _sample_text(cfg: RunConfig, arm: str, tokens: list[int]) -> str:
    """The first request's output: text for a real checkpoint, token ids for random weights."""
    if cfg.model.init != "pretrained":
        return f"sample ({arm}, random weights, first request's output token ids): {tokens[:24]}"
    from ablate.checkpoints.loader import load_tokenizer
    return f"sample ({arm}, first request's output):\n    {load_tokenizer(cfg.model).decode(tokens)!r}"

