"""What is decided about a grid point's rounds: whether enough were measured (settled), whether each
arm's tokens agree with the baseline's (check_round), and what each arm cost in quality (guard_quality)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from ablate.analysis.stats import log_interval
from ablate.api.context import EngineConfig
from ablate.api.sequence import Sequence
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.experiment import quality_guard as quality
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.quality_weights import ScoredWeights
from ablate.experiment.summary import clean_ratios
from ablate.measure.exactness import compare_greedy
from ablate.model.llama import LlamaModel
from ablate.workload.requests import WorkloadConfig


def settled(rows: list[dict[str, Any]], point: dict[str, Any], baseline: str, exp: ExperimentConfig,
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


def check_round(rows: dict[str, dict[str, Any]], seqs: dict[str, list[Sequence]], checked: set[str],
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


def guard_quality(rows: list[dict[str, Any]], point: dict[str, Any], wl: WorkloadConfig, arms: list[Arm],
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
        progress(f"{point_label(point)} quality: no perplexity: {scored.unavailable}")
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
    progress(f"{point_label(point)} quality: perplexity of {cfg.heldout_tokens - cfg.context_tokens} held-out "
             f"tokens on {scored.describe(baseline)}: " + ", ".join(f"{arm} {value:.2f}" for arm, value in ppl.items()))


def point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "workload"
