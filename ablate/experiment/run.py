"""An experiment: the same workload through several arms, interleaved, in one process.

For each grid point, warm-up runs first (excluded), then `repeats` rounds; in each round every arm
runs once, the order alternating (A B, B A, ...) so that slow drift of a shared machine falls on
every arm alike. A speedup is baseline time / arm time within one round; its median and bootstrap
95% CI are reported beside the analytic model's prediction.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from ablate.measure import device as dev
from ablate.analysis.analytic import CostModel
from ablate.engine.arm import Arm, build_arm
from ablate.api.context import EngineConfig
from ablate.measure.hardware import Peaks
from ablate.measure.memory import TensorMemoryTracker
from ablate.measure.metrics import goodput, request_table, roofline, summarise
from ablate.api.plugin import Slot
from ablate.model.llama import LlamaModel
from ablate.measure.recorder import Recorder
from ablate.engine.registry import Registry
from ablate.api.sequence import Request, Sequence
from ablate.analysis.stats import NOISY_CV, coefficient_of_variation, ratio_summary
from ablate.workload.requests import WorkloadConfig, make_requests


WARMUP_TOKENS = 8


@dataclass
class ExperimentConfig:
    name: str = "default"
    chapter: str = ""                     # e.g. ch08: tags the W&B run
    arms: dict[str, Any] = field(default_factory=dict)   # name -> {slot: plugin | {name, options}}
    baseline: str = ""                    # the arm speedups are relative to; "" -> the first
    repeats: int = 3
    warmup: int = 1                       # warm-up runs per arm, WARMUP_TOKENS each (excluded)
    grid: dict[str, list] = field(default_factory=dict)  # workload field -> values, one point each
    recorder: bool = True                 # False: time the runs with no hooks at all
    ttft_slo_ms: float | None = None      # goodput: requests meeting every SLO given
    tpot_slo_ms: float | None = None
    # CPU: count tensor bytes during each run (ablate.measure.memory), so that peak memory includes activations
    # and attention's scores, not only weights + KV; every op then runs slower (prefill-heavy runs: little)
    track_memory: bool = False
    kind: str = "engine"                  # engine: arms through the engine; costs: the cost calculator only
                                          # (ablate/costs.py; no model is loaded, arms and grid are unused)
    # techniques -> arms instead of `arms` (ablate/ablation.py): full, baseline, leave-one-out, add-one-in
    ablation: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("engine", "costs"):
            raise ValueError(f"experiment.kind must be 'engine' or 'costs', got {self.kind!r}")
        if self.repeats < 1:
            raise ValueError(f"experiment.repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"experiment.warmup must be >= 0, got {self.warmup}")
        for key, values in self.grid.items():
            if key not in WorkloadConfig.__dataclass_fields__:
                raise ValueError(f"experiment.grid: {key!r} is not a workload field; fields are "
                                 f"{', '.join(WorkloadConfig.__dataclass_fields__)}")
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"experiment.grid.{key} must be a non-empty list of values")
        if self.ablation:
            self._check_ablation()

    def _check_ablation(self) -> None:
        from ablate.experiment.ablation import parse_ablation

        parse_ablation(self.ablation)    # refuses a malformed technique list before anything runs
        if self.arms:
            raise ValueError("experiment.arms and experiment.ablation are both set: an ablation makes its own arms")
        if self.grid:   # contributions compare arms on one workload
            raise ValueError("experiment.ablation measures one workload: leave experiment.grid empty "
                             "(or sweep workload fields with -m)")
        if not self.recorder or self.kind != "engine":
            raise ValueError("experiment.ablation needs experiment.recorder=true and kind=engine: its "
                             "contributions are latency percentiles and KV bytes the recorder measures")


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
    summary: pd.DataFrame     # one row per grid point x arm: medians, speedup and its CI, prediction
    samples: dict[str, list[int]] = field(default_factory=dict)   # arm -> first request's output tokens


def grid_points(exp: ExperimentConfig, workload: WorkloadConfig) -> list[tuple[dict[str, Any], WorkloadConfig]]:
    keys = list(exp.grid)
    points = []
    for values in itertools.product(*(exp.grid[k] for k in keys)) if keys else [()]:
        point = dict(zip(keys, values))
        points.append((point, replace(workload, **point)))
    return points


def run_once(arm: Arm, model: LlamaModel, requests: list[Request], engine_cfg: EngineConfig,
             registry: Registry, peaks: Peaks | None, record: bool, track_memory: bool = False) -> ArmRun:
    """Build the arm's engine afresh and serve the requests once."""
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
    arm_model = built.engine.runner.model        # after the arm's variant (GQA, MLA...): what actually runs
    for rec in recorders:
        rec.cost_model = CostModel(arm_model.config, built.kv_cache.keeps_kv)
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
    row["kv_bytes_per_token"] = built.kv_cache.spec.bytes_per_token
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
    built.close()
    return ArmRun(row, requests_df, seqs)


def run_experiment(exp: ExperimentConfig, arms: list[Arm], model_loader: Callable[[dict], LlamaModel],
                   workload: WorkloadConfig, engine_cfg: EngineConfig, registry: Registry,
                   peaks: Peaks | None, progress: Callable[[str], None] = tqdm.write) -> ExperimentResult:
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("experiment arms need distinct names")
    baseline = exp.baseline or arms[0].name
    if baseline not in {a.name for a in arms}:
        raise ValueError(f"experiment.baseline={baseline!r} is not an arm; arms are {[a.name for a in arms]}")
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

    rows, request_frames, samples = [], [], {}
    points = grid_points(exp, workload)
    total = len(points) * len(arms) * (exp.repeats + exp.warmup)
    done = 0
    bar = tqdm(total=total, unit="run", desc=exp.name, leave=False, disable=None)   # None: only on a terminal
    for point, wl in points:
        for repeat in range(-exp.warmup, exp.repeats):
            order = arms if repeat % 2 == 0 else arms[::-1]
            for arm in order:
                model = model_for(arm)
                requests = make_requests(wl, model.config.vocab_size, tokenizer_for(model, wl))
                if repeat < 0:   # warm-up: the same prompts, a few tokens each, is enough to warm up
                    requests = [replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_TOKENS)) for r in requests]
                run = run_once(arm, model, requests, engine_cfg, registry, peaks, exp.recorder, exp.track_memory)
                has_slo = exp.ttft_slo_ms is not None or exp.tpot_slo_ms is not None
                if has_slo and not run.requests.empty:   # requests per second meeting every SLO set
                    run.row["goodput_req_s"] = goodput(run.requests, exp.ttft_slo_ms, exp.tpot_slo_ms,
                                                       run.row["duration_s"])
                done += 1
                bar.update()
                progress(f"[{done}/{total}] {_point_label(point)} arm={arm.name} "
                         f"{'warm-up' if repeat < 0 else f'repeat {repeat}'}: "
                         f"{run.row['duration_s']:.3f} s, {run.row['output_throughput_tok_s']:.1f} tok/s")
                if repeat < 0:
                    continue
                rows.append({**point, "arm": arm.name, "label": arm.label(), "repeat": repeat, **run.row})
                if not run.requests.empty:
                    request_frames.append(run.requests.assign(arm=arm.name, repeat=repeat, **point))
                samples.setdefault(arm.name, run.sequences[0].output_token_ids)
    bar.close()
    runs = pd.DataFrame(rows)
    requests_df = pd.concat(request_frames, ignore_index=True) if request_frames else pd.DataFrame()
    summary = summarise_arms(runs, list(points[0][0]), baseline, exp)
    return ExperimentResult(runs, requests_df, summary, samples)


def _point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "workload"


def plugin_stat_columns(frame: pd.DataFrame) -> list[str]:
    """The plugins' numeric stats (`slot.key` columns) that have a value in this frame."""
    prefixes = tuple(f"{slot.value}." for slot in Slot)
    return [c for c in frame.columns if c.startswith(prefixes) and pd.api.types.is_numeric_dtype(frame[c])
            and frame[c].notna().any()]


def summarise_arms(runs: pd.DataFrame, point_keys: list[str], baseline: str, exp: ExperimentConfig) -> pd.DataFrame:
    """Per grid point and arm: medians, CV, speedup vs the baseline per round, and its prediction."""
    out = []
    groups = runs.groupby(point_keys, sort=False) if point_keys else [((), runs)]
    for point, frame in groups:
        point = point if isinstance(point, tuple) else (point,)
        base = frame[frame["arm"] == baseline].set_index("repeat")
        for arm, arm_frame in frame.groupby("arm", sort=False):
            arm_frame = arm_frame.set_index("repeat")
            paired = base["duration_s"].reindex(arm_frame.index)
            ratios = (paired / arm_frame["duration_s"]).to_numpy(float)
            speedup = ratio_summary(ratios)
            row = dict(zip(point_keys, point)) | {"arm": arm, "label": arm_frame["label"].iloc[0]}
            row |= {"speedup": speedup["median"], "speedup_ci_low": speedup["ci_low"],
                    "speedup_ci_high": speedup["ci_high"]}
            if "predicted_step_time_s_total" in arm_frame:
                row["predicted_speedup"] = float(base["predicted_step_time_s_total"].median()
                                                 / arm_frame["predicted_step_time_s_total"].median())
            cv = coefficient_of_variation(arm_frame["duration_s"].to_numpy(float))
            row["duration_cv"] = cv
            row["noisy"] = bool(cv > NOISY_CV) if not np.isnan(cv) else False
            for col in ("duration_s", "output_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                        "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_emission",
                        "decode_step_q1_ms", "decode_step_q4_ms", "peak_memory_bytes",
                        "kv_reserved_peak_bytes", "kv_used_peak_bytes", "kv_util_mean", "mbu_decode", "mfu",
                        "kv_util_at_peak", "queue_p50_ms", "queue_p99_ms", "goodput_req_s", "seqs_admitted_max",
                        "seqs_admitted_mean", "seqs_admitted_while_queued", "preemptions"):
                if col in arm_frame:
                    row[col] = float(arm_frame[col].median())
            if "finish_order" in arm_frame:
                row["finish_order"] = arm_frame["finish_order"].iloc[0]   # the first repeat's
            for col in plugin_stat_columns(arm_frame):     # e.g. decoding.alpha: speculative acceptance
                row[col] = float(arm_frame[col].median())
            row["memory_ratio"] = row.get("peak_memory_bytes", np.nan) / float(base["peak_memory_bytes"].median())
            out.append(row)
    summary = pd.DataFrame(out)
    for _, r in summary[summary["noisy"]].iterrows():
        warnings.warn(f"arm {r['arm']}: run-time coefficient of variation {r['duration_cv']:.0%} is above "
                      f"{NOISY_CV:.0%}: the machine was noisy, treat its figures with care", stacklevel=2)
    return summary
