"""An experiment: the same workload through several arms, interleaved, in one process.

For each grid point, warm-up runs first (excluded), then `repeats` rounds; in each round every arm
runs once, the order alternating (A B, B A, ...) so that slow drift of a shared machine falls on
every arm alike. A speedup is baseline time / arm time within one round; its median and CI are
reported beside the analytic model's prediction.

An arm is only compared when its measurement means what it claims: an arm whose plugin breaks the
engine's contract (a PluginError: a lost request, a stalled scheduler, room never released) is
recorded as failed, with the reason, and is not run again; an arm that declares itself exact
(every plugin that differs from the baseline's is exact) but whose greedy tokens differ from the
baseline's of the same round beyond rounding (ablate.measure.exactness) is recorded as diverged.
Neither gets a speedup.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
from tqdm import tqdm

from ablate.analysis.analytic import CostModel
from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sequence import Request, Sequence
from ablate.engine.arm import Arm, build_arm
from ablate.engine.registry import Registry
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.summary import summarise_arms
from ablate.measure import device as dev
from ablate.measure.exactness import compare_greedy
from ablate.measure.hardware import Peaks
from ablate.measure.memory import TensorMemoryTracker
from ablate.measure.metrics import goodput, request_table, roofline, summarise
from ablate.measure.recorder import Recorder
from ablate.model.llama import LlamaModel
from ablate.report.declared import Declarations
from ablate.workload.requests import WorkloadConfig, make_requests

WARMUP_TOKENS = 8


@dataclass
class ArmRun:
    """The figures of one arm on one grid point in one round."""

    row: dict[str, Any]
    requests: pd.DataFrame
    sequences: list[Sequence]


@dataclass
class ExperimentResult:
    runs: pd.DataFrame        # one row per grid point x arm x repeat
    requests: pd.DataFrame    # one row per request of every run
    summary: pd.DataFrame     # one row per grid point x arm: medians, speedup and its CI, prediction, status
    samples: dict[str, list[int]] = field(default_factory=dict)   # arm -> first request's output tokens
    declared: Declarations = field(default_factory=Declarations)   # the plugins' stats and figures


def grid_points(exp: ExperimentConfig, workload: WorkloadConfig) -> list[tuple[dict[str, Any], WorkloadConfig]]:
    keys = list(exp.grid)
    points = []
    for values in itertools.product(*(exp.grid[k] for k in keys)) if keys else [()]:
        point = dict(zip(keys, values))
        points.append((point, replace(workload, **point)))
    return points


def expects_baseline_tokens(arm: Arm, baseline: Arm, registry: Registry) -> bool:
    """Every plugin the arm changes is declared exact, on the same model: its greedy tokens must be
    the baseline's."""
    if arm.name == baseline.name or arm.model_overrides != baseline.model_overrides:
        return False
    return all(registry.get(slot, config.name).exact for slot, config in arm.plugins.items()
               if config != baseline.plugins[slot])


def run_once(arm: Arm, model: LlamaModel, requests: list[Request], engine_cfg: EngineConfig,
             registry: Registry, peaks: Peaks | None, record: bool, track_memory: bool = False) -> ArmRun:
    """Build the arm's engine afresh and serve the requests once. A plugin that breaks the contract
    raises PluginError (the engine's checks)."""
    max_seq_len = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    max_seq_len = engine_cfg.max_seq_len or max_seq_len
    if max_seq_len > model.config.max_seq_len:
        raise ValueError(f"the workload needs {max_seq_len} tokens per sequence but model.max_seq_len is "
                         f"{model.config.max_seq_len}; raise model.max_seq_len or shorten the workload")
    recorders: list[Recorder] = []

    def hooks(kv_cache):
        if not record:
            return ()
        recorders.append(Recorder(kv_cache))
        return recorders

    built = build_arm(arm, model, engine_cfg, max_seq_len, registry, hooks)
    try:
        arm_model = built.engine.runner.model        # after the arm's variant (GQA, MLA...): what actually runs
        for rec in recorders:
            rec.cost_model = CostModel(arm_model.config, built.kv_cache.keeps_kv, built.kv_cache.bytes_per_token)
        device = built.engine.device
        tracker = TensorMemoryTracker() if track_memory and device.type != "cuda" else contextlib.nullcontext()
        kv_reserved_before = built.kv_cache.bytes_reserved()
        gc.collect()
        dev.reset_peak_memory(device)
        start = dev.now(device)
        with tracker:
            seqs = built.engine.run(requests)
        wall = dev.now(device) - start
        row: dict[str, Any] = {"wall_s": wall}
        if record:
            rec = recorders[0]
            row |= summarise(rec)
            if peaks is not None:
                row |= roofline(rec, peaks)
            requests_df = request_table(rec)
        else:
            row |= {"duration_s": wall, "output_tokens": sum(s.num_output_tokens for s in seqs)}
            row["output_throughput_tok_s"] = row["output_tokens"] / wall
            requests_df = pd.DataFrame()
        row["kv_bytes_per_token"] = built.kv_cache.bytes_per_token
        row["weight_bytes"] = arm_model.weight_bytes()
        cuda_peak = dev.peak_memory_bytes(device)
        # peak memory: the CUDA allocator's peak; on the CPU the tensors we track (weights + KV) and RSS
        row["peak_memory_bytes"] = cuda_peak if cuda_peak is not None else row["weight_bytes"] + row.get(
            "kv_reserved_peak_bytes", 0)
        if isinstance(tracker, TensorMemoryTracker):
            # weights and KV held before the run, plus everything the run allocated that was live at once
            row["tracked_peak_bytes"] = tracker.peak_bytes
            row["peak_memory_bytes"] = row["weight_bytes"] + kv_reserved_before + tracker.peak_bytes
        row["rss_bytes"] = dev.process_rss_bytes()
        row["attention_backend"] = built.plugins[Slot.ATTENTION].backend
        row |= built.stats()
    finally:
        built.close()
    return ArmRun(row | {"status": "ok", "status_detail": ""}, requests_df, seqs)


def run_experiment(exp: ExperimentConfig, arms: list[Arm], model_loader: Callable[[dict], LlamaModel],
                   workload: WorkloadConfig, engine_cfg: EngineConfig, registry: Registry,
                   peaks: Peaks | None, progress: Callable[[str], None] = tqdm.write) -> ExperimentResult:
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("experiment arms need distinct names")
    baseline_name = exp.baseline or arms[0].name
    if baseline_name not in {a.name for a in arms}:
        raise ValueError(f"experiment.baseline={baseline_name!r} is not an arm; arms are {[a.name for a in arms]}")
    baseline = next(a for a in arms if a.name == baseline_name)
    models: dict[str, LlamaModel] = {}
    tokenizers: dict[str, Any] = {}

    def model_for(arm: Arm) -> LlamaModel:
        key = repr(sorted(arm.model_overrides.items()))
        if key not in models:
            models[key] = model_loader(arm.model_overrides)
        return models[key]

    def tokenizer_for(model: LlamaModel, wl: WorkloadConfig):
        """The model's tokenizer, for workloads of text prompts (loaded once per checkpoint)."""
        if wl.source != "text":
            return None
        from ablate.checkpoints.loader import load_tokenizer
        key = repr((model.config.path, model.config.package))
        if key not in tokenizers:
            tokenizers[key] = load_tokenizer(model.config)
        return tokenizers[key]

    checked = {a.name for a in arms if expects_baseline_tokens(a, baseline, registry)}
    failed: dict[str, str] = {}         # arm -> why, once a plugin broke the contract
    rows, request_frames, samples = [], [], {}
    points = grid_points(exp, workload)
    total = len(points) * len(arms) * (exp.repeats + exp.warmup)
    done = 0
    bar = tqdm(total=total, unit="run", desc=exp.name, leave=False, disable=None)   # None: only on a terminal
    for point, wl in points:
        for repeat in range(-exp.warmup, exp.repeats):
            order = arms if repeat % 2 == 0 else arms[::-1]
            round_seqs: dict[str, list[Sequence]] = {}
            round_rows: dict[str, dict[str, Any]] = {}
            for arm in order:
                done += 1
                bar.update()
                where = f"[{done}/{total}] {_point_label(point)} arm={arm.name} " + (
                    "warm-up" if repeat < 0 else f"repeat {repeat}")
                model = model_for(arm)
                requests = make_requests(wl, model.config.vocab_size, tokenizer_for(model, wl))
                if repeat < 0:   # warm-up: the same prompts, a few tokens each, is enough to warm up
                    requests = [replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_TOKENS)) for r in requests]
                if arm.name in failed:
                    run = ArmRun({"status": "failed", "status_detail": failed[arm.name]}, pd.DataFrame(), [])
                else:
                    try:
                        run = run_once(arm, model, requests, engine_cfg, registry, peaks, exp.recorder,
                                       exp.track_memory)
                    except PluginError as err:
                        failed[arm.name] = f"{err}"
                        progress(f"{where}: FAILED, not measured again: {err}")
                        run = ArmRun({"status": "failed", "status_detail": failed[arm.name]}, pd.DataFrame(), [])
                if run.row["status"] == "ok":
                    has_slo = exp.ttft_slo_ms is not None or exp.tpot_slo_ms is not None
                    if has_slo and not run.requests.empty:   # requests per second meeting every SLO set
                        run.row["goodput_req_s"] = goodput(run.requests, exp.ttft_slo_ms, exp.tpot_slo_ms,
                                                           run.row["duration_s"])
                    progress(f"{where}: {run.row['duration_s']:.3f} s, {run.row['output_throughput_tok_s']:.1f} tok/s")
                    round_seqs[arm.name] = run.sequences
                if repeat < 0:
                    continue
                round_rows[arm.name] = row = {**point, "arm": arm.name, "label": arm.label(), "repeat": repeat,
                                              **run.row}
                rows.append(row)
                if not run.requests.empty:
                    request_frames.append(run.requests.assign(arm=arm.name, repeat=repeat, **point))
                if run.sequences:
                    samples.setdefault(arm.name, run.sequences[0].output_token_ids)
            if repeat >= 0:
                _check_exactness(round_rows, round_seqs, checked, baseline_name, model_for(baseline))
    bar.close()
    runs = pd.DataFrame(rows)
    requests_df = pd.concat(request_frames, ignore_index=True) if request_frames else pd.DataFrame()
    declared = Declarations.of(registry.get(slot, config.name) for arm in arms for slot, config in arm.plugins.items())
    summary = summarise_arms(runs, list(points[0][0]), baseline_name, declared.stats)
    return ExperimentResult(runs, requests_df, summary, samples, declared)


def _check_exactness(rows: dict[str, dict[str, Any]], seqs: dict[str, list[Sequence]], checked: set[str],
                     baseline: str, model: LlamaModel) -> None:
    """Arms that must give the baseline's greedy tokens, compared with the baseline's of this round."""
    if baseline not in seqs:
        return
    for arm in checked & set(seqs):
        agreement = compare_greedy(model, seqs[baseline], seqs[arm])
        rows[arm]["baseline_agreement"] = agreement.rate
        if not agreement.matches:
            rows[arm]["status"] = "diverged"
            rows[arm]["status_detail"] = (
                f"declared exact, but {agreement.num_diverged} of {agreement.num_compared} greedy requests differ "
                f"from the baseline's beyond rounding; first: {agreement.first_divergence}")


def _point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "workload"
