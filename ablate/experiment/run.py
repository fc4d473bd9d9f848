"""An experiment: the same workload through several arms, interleaved, in one process.

For each grid point, warm-up runs first (excluded: the whole workload, so that every shape a round
meets has had its kernels compiled and its product paths timed), then rounds; in each round every arm runs once,
the order alternating (A B, B A, ...) so that slow drift of a shared machine falls on every arm
alike. A speedup is baseline time / arm time within one round; its geometric mean and t-interval
over rounds (ablate.analysis.stats) are reported beside the analytic model's prediction.

Rounds: `repeats` of them; with `max_repeats` above that, more until every arm's speedup interval
is narrower than `ci_target` (relative half-width), `max_repeats` is reached or `time_budget_s`
is spent, as pyperf and hyperfine repeat until the figure settles. Each finished round is handed to
`on_round` (the job persists it), and rounds already measured (`done`) are not measured again.

An arm is only compared when its measurement means what it claims: an arm whose plugin breaks the
engine's contract (a PluginError: a lost request, a stalled scheduler, room never released) is
recorded as failed, with the reason, and is not run again; an arm that declares itself exact
(every plugin that differs from the baseline's is exact) but whose greedy tokens differ from the
baseline's of the same round beyond rounding (ablate.measure.exactness) is recorded as diverged;
an arm whose text moved away from the baseline's (ablate.experiment.quality_guard) is degraded.
None of them gets a speedup.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError
from ablate.api.sequence import Sequence
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.experiment.arm_run import expects_baseline_tokens, run_once, with_fixed_kv_budget
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.quality_weights import ScoredWeights
from ablate.experiment.round_checks import check_round, guard_quality, point_label, settled
from ablate.experiment.summary import summarise_arms
from ablate.measure.cpu_load import CpuShareMeter
from ablate.measure.hardware import Peaks
from ablate.measure.metrics import ArmRun, goodput, ttft_slo_attainment
from ablate.model.llama import LlamaModel
from ablate.outside.contract import OutsideEngineError
from ablate.outside.runs import OutsideRuns
from ablate.report.declared import Declarations
from ablate.workload.requests import WorkloadConfig, make_requests


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


def finished_rounds(done: pd.DataFrame, point: dict[str, Any], arms: list[Arm]) -> pd.DataFrame:
    """The rows of `done` at this grid point whose round has every arm (a round cut short is run again)."""
    if done.empty:
        return done
    mask = np.logical_and.reduce([done[k] == v for k, v in point.items()]) if point else np.ones(len(done), bool)
    rows = done[mask]
    complete = rows.groupby("repeat")["arm"].agg(lambda a: set(a) >= {arm.name for arm in arms})
    return rows[rows["repeat"].isin(complete[complete].index)]


def run_experiment(exp: ExperimentConfig, arms: list[Arm], model_loader: Callable[[dict], LlamaModel],
                   workload: WorkloadConfig, engine_cfg: EngineConfig, registry: Registry,
                   peaks: Peaks | None, progress: Callable[[str], None] = tqdm.write,
                   done: tuple[pd.DataFrame, pd.DataFrame] | None = None,
                   on_round: Callable[[pd.DataFrame, pd.DataFrame], None] | None = None,
                   kv_free_bytes: int | None = None) -> ExperimentResult:
    """Measure every grid point; `done` = (runs, requests) already measured, `on_round(runs, requests)`
    is called with everything measured so far after each round. `kv_free_bytes`: the memory free at the
    job's start, what every arm's kv_cache.budget_fraction is a share of (None: each reads its own)."""
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("experiment arms need distinct names")
    baseline = exp.baseline or arms[0].name
    if baseline not in {a.name for a in arms}:
        raise ValueError(f"experiment.baseline={baseline!r} is not an arm; arms are {[a.name for a in arms]}")
    done_runs, done_requests = done if done is not None else (pd.DataFrame(), pd.DataFrame())
    points = grid_points(exp, workload)
    experiment = Interleaved(exp, arms, baseline, model_loader, engine_cfg, registry, peaks, progress,
                             kv_free_bytes, done_runs, num_points=len(points))
    try:
        for point, wl in points:
            experiment.run_point(point, wl, done_runs, done_requests, on_round)
    finally:
        experiment.close()
    return experiment.result(list(points[0][0]))


class Interleaved:
    """One experiment while it runs: the models and tokenizers loaded once, the arms that failed (not
    run again), the rows and requests measured so far."""

    def __init__(self, exp: ExperimentConfig, arms: list[Arm], baseline: str, model_loader: Callable[[dict], LlamaModel],
                 engine_cfg: EngineConfig, registry: Registry, peaks: Peaks | None, progress: Callable[[str], None],
                 kv_free_bytes: int | None, done_runs: pd.DataFrame, num_points: int) -> None:
        self.exp, self.engine_cfg, self.registry, self.peaks, self.progress = exp, engine_cfg, registry, peaks, progress
        self.model_loader = model_loader
        self.models: dict[str, LlamaModel] = {}
        self.tokenizers: dict[str, Any] = {}
        self.arms = [with_fixed_kv_budget(a, kv_free_bytes, self.model_for) for a in arms]
        self.baseline = next(a for a in self.arms if a.name == baseline)
        self.scored = ScoredWeights(exp.quality, self.model_for, model_loader)   # the weights the quality guard scores
        self.checked = {a.name for a in self.arms if expects_baseline_tokens(a, self.baseline, registry)}
        self.failed: dict[str, str] = {}     # arm -> why, once a plugin broke the contract (or it cannot run here)
        self.skipped = {a.name: why for a in self.arms if a.outside is not None and (why := a.outside[0].missing())}
        for arm, why in self.skipped.items():    # an outside engine not installed: one line, never a crash
            self.failed[arm] = why
            progress(f"arm {arm}: skipped: {why}")
        if not done_runs.empty and "status" in done_runs:
            self.failed |= {r.arm: r.status_detail for r in done_runs[done_runs["status"] == "failed"].itertuples()}
        self.outside = OutsideRuns(engine_cfg.max_num_seqs)
        self.rows: list[dict[str, Any]] = []
        self.request_frames: list[pd.DataFrame] = []
        self.samples: dict[str, list[int]] = {}
        self.bar = tqdm(total=num_points * len(arms) * (exp.repeats + exp.warmup), unit="run", desc=exp.name,
                        leave=False, disable=None)   # None: only on a terminal
        self.started = time.perf_counter()

    def model_for(self, arm: Arm) -> LlamaModel:
        key = repr(sorted(arm.model_overrides.items()))
        if key not in self.models:
            self.models[key] = self.model_loader(arm.model_overrides)
        return self.models[key]

    def tokenizer_for(self, model: LlamaModel, wl: WorkloadConfig):
        """The model's tokenizer, for workloads of text prompts (loaded once per checkpoint)."""
        if not wl.needs_tokenizer:
            return None
        from ablate.checkpoints.loader import load_tokenizer
        key = repr((model.config.path, model.config.package))
        if key not in self.tokenizers:
            self.tokenizers[key] = load_tokenizer(model.config)
        return self.tokenizers[key]

    def run_point(self, point: dict[str, Any], wl: WorkloadConfig, done_runs: pd.DataFrame,
                  done_requests: pd.DataFrame, on_round) -> None:
        """The warm-up and the rounds of one grid point (those not measured already), then its quality."""
        exp = self.exp
        prior = finished_rounds(done_runs, point, self.arms)
        self.rows += prior.to_dict("records")
        if not done_requests.empty and not prior.empty:
            keys = [*point, "arm", "repeat"]
            self.request_frames.append(done_requests.merge(prior[keys], on=keys))
        measured = set(prior["repeat"]) if not prior.empty else set()
        if measured:
            self.progress(f"{point_label(point)}: {len(measured)} round(s) already measured, kept")
        for repeat in range(-exp.warmup, max(exp.repeats, exp.max_repeats)):
            if repeat >= 0 and repeat in measured:
                continue
            if repeat >= exp.repeats and settled(self.rows, point, self.baseline.name, exp, self.started):
                break
            if repeat < 0 and len(measured) >= exp.repeats:
                continue         # nothing left to measure at this point: no warm-up either
            self.run_round(point, wl, repeat)
            if repeat >= 0 and on_round is not None:
                on_round(pd.DataFrame(self.rows), _concat(self.request_frames))
        if exp.quality.enabled:
            guard_quality(self.rows, point, wl, self.arms, self.baseline, self.scored, self.tokenizer_for,
                          self.engine_cfg, self.registry, exp.quality, self.progress)

    def run_round(self, point: dict[str, Any], wl: WorkloadConfig, repeat: int) -> None:
        """Every arm once, in alternating order (a negative repeat: a warm-up, not recorded)."""
        seqs: dict[str, list[Sequence]] = {}
        rows: dict[str, dict[str, Any]] = {}
        for arm in self.arms if repeat % 2 == 0 else self.arms[::-1]:
            where = f"{point_label(point)} arm={arm.name} " + ("warm-up" if repeat < 0 else f"round {repeat + 1}")
            run = self.measure(arm, wl, where, warmup=repeat < 0)
            if repeat < 0:
                continue
            if run.row["status"] == "ok":
                seqs[arm.name] = run.sequences
            rows[arm.name] = row = {**point, "arm": arm.name, "label": arm.label(), "repeat": repeat, **run.row}
            self.rows.append(row)
            if not run.requests.empty:
                self.request_frames.append(run.requests.assign(arm=arm.name, repeat=repeat, **point))
            if run.sequences:
                self.samples.setdefault(arm.name, run.sequences[0].output_token_ids)
        if repeat >= 0:
            check_round(rows, seqs, self.checked, self.baseline.name, self.model_for(self.baseline))

    def measure(self, arm: Arm, wl: WorkloadConfig, where: str, warmup: bool) -> ArmRun:
        """One run of one arm (a failed arm is not run again: its row says why)."""
        exp = self.exp
        self.bar.update()
        model = self.model_for(arm)
        requests = make_requests(wl, model.config.vocab_size, self.tokenizer_for(model, wl), model.config.max_seq_len)
        if arm.name in self.failed:
            status = "skipped" if arm.name in self.skipped else "failed"
            return ArmRun({"status": status, "status_detail": self.failed[arm.name]}, pd.DataFrame(), [])
        try:
            with CpuShareMeter(host_threads(model)) as cpu:
                if arm.outside is not None:
                    run = self.outside.run(arm, model, requests, exp.track_memory)
                else:
                    run = run_once(arm, model, requests, self.engine_cfg, self.registry, self.peaks, exp.recorder,
                                   exp.track_memory)
            run.row |= cpu.row()
        except (PluginError, SystemExit, OutsideEngineError) as err:   # SystemExit: a plugin's sys.exit
            self.failed[arm.name] = (f"a plugin of the arm called sys.exit({err})" if isinstance(err, SystemExit)
                                     else f"{err}")
            self.progress(f"{where}: FAILED, not measured again: {self.failed[arm.name]}")
            return ArmRun({"status": "failed", "status_detail": self.failed[arm.name]}, pd.DataFrame(), [])
        has_slo = exp.ttft_slo_ms is not None or exp.tpot_slo_ms is not None
        if has_slo and not run.requests.empty:   # requests per second meeting every SLO set
            run.row["goodput_req_s"] = goodput(run.requests, exp.ttft_slo_ms, exp.tpot_slo_ms, run.row["duration_s"])
        if exp.ttft_slo_ms is not None and not run.requests.empty:   # the TTFT SLO alone: goodput, attainment
            run.row |= ttft_slo_attainment(run.requests, exp.ttft_slo_ms, run.row["duration_s"])
        contended = (f", CONTENDED: others took {1 - run.row['cpu_left_share']:.0%} of its CPU, left out of the "
                     "speedup" if run.row.get("contended") and not warmup else "")
        self.progress(f"{where}: {run.row['duration_s']:.3f} s, {run.row['output_throughput_tok_s']:.1f} tok/s"
                      f"{contended}")
        return run

    def close(self) -> None:
        self.outside.close()
        self.bar.close()

    def result(self, point_keys: list[str]) -> ExperimentResult:
        runs = pd.DataFrame(self.rows)
        declared = Declarations.of(self.registry.get(slot, config.name)
                                   for arm in self.arms for slot, config in arm.plugins.items())
        summary = summarise_arms(runs, point_keys, self.baseline.name, declared.stats)
        return ExperimentResult(runs, _concat(self.request_frames), summary, self.samples, declared)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def host_threads(model: LlamaModel) -> int:
    """The threads a run keeps busy: torch's on a CPU; the one that drives a GPU."""
    return torch.get_num_threads() if next(model.parameters()).device.type == "cpu" else 1


