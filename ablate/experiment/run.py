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
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from ablate.analysis.stats import log_interval
from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError
from ablate.api.sequence import Sequence
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.outside.runs import OutsideRuns
from ablate.outside.contract import OutsideEngineError
from ablate.experiment import quality_guard as quality
from ablate.experiment.arm_run import ArmRun, expects_baseline_tokens, run_once, with_fixed_kv_budget
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.quality_weights import ScoredWeights
from ablate.experiment.summary import clean_ratios, summarise_arms
from ablate.measure.cpu_load import CpuShareMeter
from ablate.measure.exactness import compare_greedy
from ablate.measure.hardware import Peaks
from ablate.measure.metrics import goodput, ttft_slo_attainment
from ablate.model.llama import LlamaModel
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
    baseline_name = exp.baseline or arms[0].name
    if baseline_name not in {a.name for a in arms}:
        raise ValueError(f"experiment.baseline={baseline_name!r} is not an arm; arms are {[a.name for a in arms]}")
    models: dict[str, LlamaModel] = {}
    tokenizers: dict[str, Any] = {}

    def model_for(arm: Arm) -> LlamaModel:
        key = repr(sorted(arm.model_overrides.items()))
        if key not in models:
            models[key] = model_loader(arm.model_overrides)
        return models[key]

    arms = [with_fixed_kv_budget(a, kv_free_bytes, model_for) for a in arms]
    baseline = next(a for a in arms if a.name == baseline_name)
    scored = ScoredWeights(exp.quality, model_for, model_loader)    # the weights the quality guard scores

    def tokenizer_for(model: LlamaModel, wl: WorkloadConfig):
        """The model's tokenizer, for workloads of text prompts (loaded once per checkpoint)."""
        if not wl.needs_tokenizer:
            return None
        from ablate.checkpoints.loader import load_tokenizer
        key = repr((model.config.path, model.config.package))
        if key not in tokenizers:
            tokenizers[key] = load_tokenizer(model.config)
        return tokenizers[key]

    done_runs, done_requests = done if done is not None else (pd.DataFrame(), pd.DataFrame())
    checked = {a.name for a in arms if expects_baseline_tokens(a, baseline, registry)}
    failed: dict[str, str] = {}         # arm -> why, once a plugin broke the contract (or it cannot run here)
    skipped = {a.name: why for a in arms if a.outside is not None and (why := a.outside[0].missing())}
    for arm, why in skipped.items():    # an outside engine not installed: one line, never a crash
        failed[arm] = why
        progress(f"arm {arm}: skipped: {why}")
    outside = OutsideRuns(engine_cfg.max_num_seqs)
    if not done_runs.empty and "status" in done_runs:
        failed |= {r.arm: r.status_detail for r in done_runs[done_runs["status"] == "failed"].itertuples()}
    rows: list[dict[str, Any]] = []
    request_frames: list[pd.DataFrame] = []
    samples: dict[str, list[int]] = {}
    points = grid_points(exp, workload)
    max_rounds = max(exp.repeats, exp.max_repeats)
    bar = tqdm(total=len(points) * len(arms) * (exp.repeats + exp.warmup), unit="run", desc=exp.name,
               leave=False, disable=None)   # None: only on a terminal
    started = time.perf_counter()

    def measure(arm: Arm, wl: WorkloadConfig, where: str, warmup: bool) -> ArmRun:
        bar.update()
        model = model_for(arm)
        requests = make_requests(wl, model.config.vocab_size, tokenizer_for(model, wl), model.config.max_seq_len)
        if arm.name in failed:
            status = "skipped" if arm.name in skipped else "failed"
            return ArmRun({"status": status, "status_detail": failed[arm.name]}, pd.DataFrame(), [])
        try:
            with CpuShareMeter(host_threads(model)) as cpu:
                if arm.outside is not None:
                    run = outside.run(arm, model, requests, exp.track_memory)
                else:
                    run = run_once(arm, model, requests, engine_cfg, registry, peaks, exp.recorder, exp.track_memory)
            run.row |= cpu.row()
        except (PluginError, SystemExit, OutsideEngineError) as err:   # SystemExit: a plugin's sys.exit
            failed[arm.name] = (f"a plugin of the arm called sys.exit({err})" if isinstance(err, SystemExit)
                                else f"{err}")
            progress(f"{where}: FAILED, not measured again: {failed[arm.name]}")
            return ArmRun({"status": "failed", "status_detail": failed[arm.name]}, pd.DataFrame(), [])
        has_slo = exp.ttft_slo_ms is not None or exp.tpot_slo_ms is not None
        if has_slo and not run.requests.empty:   # requests per second meeting every SLO set
            run.row["goodput_req_s"] = goodput(run.requests, exp.ttft_slo_ms, exp.tpot_slo_ms, run.row["duration_s"])
        if exp.ttft_slo_ms is not None and not run.requests.empty:   # the TTFT SLO alone: goodput, attainment
            run.row |= ttft_slo_attainment(run.requests, exp.ttft_slo_ms, run.row["duration_s"])
        contended = (f", CONTENDED: others took {1 - run.row['cpu_left_share']:.0%} of its CPU, left out of the "
                     "speedup" if run.row.get("contended") and not warmup else "")
        progress(f"{where}: {run.row['duration_s']:.3f} s, {run.row['output_throughput_tok_s']:.1f} tok/s{contended}")
        return run

    try:
        for point, wl in points:
            prior = finished_rounds(done_runs, point, arms)
            rows += prior.to_dict("records")
            if not done_requests.empty and not prior.empty:
                request_frames.append(done_requests.merge(prior[[*point, "arm", "repeat"]], on=[*point, "arm", "repeat"]))
            measured_rounds = set(prior["repeat"]) if not prior.empty else set()
            label = _point_label(point)
            if measured_rounds:
                progress(f"{label}: {len(measured_rounds)} round(s) already measured, kept")
            for repeat in range(-exp.warmup, max_rounds):
                if repeat >= 0 and repeat in measured_rounds:
                    continue
                if repeat >= exp.repeats and _settled(rows, point, baseline_name, exp, started):
                    break
                if repeat < 0 and len(measured_rounds) >= exp.repeats:
                    continue         # nothing left to measure at this point: no warm-up either
                order = arms if repeat % 2 == 0 else arms[::-1]
                round_seqs: dict[str, list[Sequence]] = {}
                round_rows: dict[str, dict[str, Any]] = {}
                for arm in order:
                    where = f"{label} arm={arm.name} " + ("warm-up" if repeat < 0 else f"round {repeat + 1}")
                    run = measure(arm, wl, where, warmup=repeat < 0)
                    if repeat < 0:
                        continue
                    if run.row["status"] == "ok":
                        round_seqs[arm.name] = run.sequences
                    round_rows[arm.name] = row = {**point, "arm": arm.name, "label": arm.label(), "repeat": repeat,
                                                  **run.row}
                    rows.append(row)
                    if not run.requests.empty:
                        request_frames.append(run.requests.assign(arm=arm.name, repeat=repeat, **point))
                    if run.sequences:
                        samples.setdefault(arm.name, run.sequences[0].output_token_ids)
                if repeat >= 0:
                    _check_round(round_rows, round_seqs, checked, baseline_name, model_for(baseline))
                    if on_round is not None:
                        on_round(pd.DataFrame(rows), _concat(request_frames))
            if exp.quality.enabled:
                _guard_quality(rows, point, wl, arms, baseline, scored, tokenizer_for, engine_cfg, registry,
                               exp.quality, progress)
    finally:
        outside.close()
    bar.close()
    runs = pd.DataFrame(rows)
    declared = Declarations.of(registry.get(slot, config.name) for arm in arms for slot, config in arm.plugins.items())
    summary = summarise_arms(runs, list(points[0][0]), baseline_name, declared.stats)
    return ExperimentResult(runs, _concat(request_frames), summary, samples, declared)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def host_threads(model: LlamaModel) -> int:
    """The threads a run keeps busy: torch's on a CPU; the one that drives a GPU."""
    return torch.get_num_threads() if next(model.parameters()).device.type == "cpu" else 1


def _settled(rows: list[dict[str, Any]], point: dict[str, Any], baseline: str, exp: ExperimentConfig,
             started: float) -> bool:
    """Past the minimum rounds: stop when the time budget is spent, or when every ok arm has `repeats`
    rounds in which neither it nor the baseline was contended and its speedup interval over them is
    narrower than ci_target."""
    if exp.time_budget_s and time.perf_counter() - started > exp.time_budget_s:
        return True
    here = pd.DataFrame([r for r in rows if all(r.get(k) == v for k, v in point.items())])
    base = here[(here["arm"] == baseline) & (here["status"] == "ok")].set_index("repeat")
    for _, frame in here.groupby("arm"):
        if (frame["status"] != "ok").any():
            continue
        clean, _ = clean_ratios(base, frame.set_index("repeat"))
        if len(clean) < exp.repeats or log_interval(clean).relative_half_width > exp.ci_target:
            return False
    return True


def _check_round(rows: dict[str, dict[str, Any]], seqs: dict[str, list[Sequence]], checked: set[str],
                 baseline: str, model: LlamaModel) -> None:
    """Every arm's greedy tokens against the baseline's of this round (token_agreement); arms that
    must give them exactly are checked up to rounding (ablate.measure.exactness)."""
    if baseline not in seqs:
        return
    for arm in seqs:
        rows[arm]["token_agreement"] = quality.token_agreement(seqs[baseline], seqs[arm])
    for arm in checked & set(seqs):
        agreement = compare_greedy(model, seqs[baseline], seqs[arm])
        rows[arm]["baseline_agreement"] = agreement.rate
        if not agreement.matches:
            rows[arm]["status"] = "diverged"
            rows[arm]["status_detail"] = (
                f"declared exact, but {agreement.num_diverged} of {agreement.num_compared} greedy requests differ "
                f"from the baseline's beyond rounding; first: {agreement.first_divergence}")


def _guard_quality(rows: list[dict[str, Any]], point: dict[str, Any], wl: WorkloadConfig, arms: list[Arm],
                   baseline: Arm, scored: ScoredWeights, tokenizer_for, engine_cfg: EngineConfig, registry: Registry,
                   cfg: quality.QualityConfig, progress: Callable[[str], None]) -> None:
    """Perplexity ratio of each arm on held-out text, then the verdict on every round's row."""
    here = [r for r in rows if all(r.get(k) == v for k, v in point.items())]
    outside = {a.name for a in arms if a.outside is not None}    # an outside engine's perplexity is not ours to score
    ok_arms = [a for a in arms if a.name not in outside and any(r["arm"] == a.name and r["status"] == "ok" for r in here)]
    if baseline not in ok_arms:
        return
    ppl = scored.perplexities([baseline] + [a for a in ok_arms if a is not baseline], lambda m: tokenizer_for(m, wl),
                              wl.seed, engine_cfg, registry)
    if not ppl:
        progress(f"{_point_label(point)} quality: no perplexity: {scored.unavailable}")
        return
    for row in here:
        if row["arm"] in outside:        # no perplexity: its greedy tokens against the baseline's are its quality
            row["ppl_ratio"] = math.nan
        elif row["arm"] not in ppl:
            continue
        else:
            row["perplexity"] = ppl[row["arm"]]
            row["ppl_ratio"] = ppl[row["arm"]] / ppl[baseline.name]
        lost = scored.verdict(row["ppl_ratio"], row.get("token_agreement", math.nan))
        if lost and row["status"] == "ok":
            row["status"], row["status_detail"] = quality.DEGRADED, lost
    progress(f"{_point_label(point)} quality: perplexity of {cfg.heldout_tokens - cfg.context_tokens} held-out "
             f"tokens on {scored.describe(baseline)}: " + ", ".join(f"{arm} {value:.2f}" for arm, value in ppl.items()))


def _point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "workload"
