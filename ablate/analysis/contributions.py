"""What each technique of an ablation buys, from the measured arms (ablate.analysis.ablation_plan
plans them).

Contributions, per metric m and round r (every arm runs once per round, interleaved, so arms of one
round saw the same machine), as with / without ratios, their geometric mean and t 95% CI over rounds
(ablate.analysis.stats.log_interval, as summarise_arms does for speedups; no CI under 3 rounds):

  add-one-in of t      m(+t)_r / m(t's requirements)_r          (the baseline when it requires none)
  leave-one-out of t   m(full)_r / m(-t)_r
  interaction of t     leave-one-out / add-one-in of t's unit, per round: 1 when t's effect does not
                       depend on the other techniques. t interacts when the CI exists and excludes 1
                       and the ratio differs from 1 by more than `interaction_tolerance` (relative).
  pair a x b           m(A|B)_r m(A&B)_r / (m(A)_r m(B)_r), A and B the closures of a and b: the
                       2x2 factorial interaction (1: independent, multiplicative effects); judged by
                       the same rule. Nested pairs (b requires a) have no such square and are not judged.
                       A pair is reported whenever its four arms were measured, `pairs: true` or not.
Rounds measured on a contended CPU are left out. An arm the quality guardrail marked degraded keeps its ratios, and every row using it says what it
lost (the note): a faster arm whose text degenerated is read with that cost.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd

from ablate.analysis.stats import log_interval
from ablate.analysis.ablation_plan import AblationConfig, set_name

# the metrics a contribution is reported for: column of runs.csv -> (label, higher is better)
METRICS: dict[str, tuple[str, bool]] = {
    "output_throughput_tok_s": ("output throughput", True),
    "ttft_p99_ms": ("TTFT p99", False),
    "tpot_p99_ms": ("TPOT p99", False),
    "kv_reserved_peak_bytes": ("peak KV bytes", False),
}



def per_round(runs: pd.DataFrame, arm: str, metric: str) -> pd.Series:
    """The metric of one arm, indexed by round (repeat); empty for an arm that never ran. A round in
    which other work took the CPU (`contended`, ablate.measure.cpu_load) is left out, as for speedups."""
    frame = runs[runs["arm"] == arm]
    if "contended" in frame:
        frame = frame[~frame["contended"].astype("boolean").fillna(False).to_numpy(bool)]
    if metric not in frame:
        return pd.Series(dtype=float)
    return frame.set_index("repeat")[metric].astype(float)


def paired_ratios(runs: pd.DataFrame, numerator: str, denominator: str, metric: str) -> pd.Series:
    """numerator / denominator within each round; NaN where either is missing or the denominator is 0."""
    num, den = per_round(runs, numerator, metric), per_round(runs, denominator, metric)
    rounds = num.index.union(den.index)
    num, den = num.reindex(rounds), den.reindex(rounds)
    return num / den.where(den != 0)


def summarise_ratios(ratios: pd.Series) -> dict[str, float]:
    """Geometric mean of the ratios ("ratio"), CI, rounds and why no CI."""
    interval = log_interval(ratios.to_numpy(float))
    return {"ratio": interval.center, "ci_low": interval.low, "ci_high": interval.high, "rounds": interval.n,
            "ci_note": interval.note}


def interacts(ratio: float, ci_low: float, ci_high: float, tolerance: float) -> bool:
    """Not independent: the CI exists and excludes 1, and the ratio departs from 1 by more than
    `tolerance`. No CI (too few rounds) never supports the claim."""
    if not np.isfinite([ratio, ci_low, ci_high]).all():
        return False
    return bool((ci_low > 1 or ci_high < 1) and abs(np.log(ratio)) > np.log1p(tolerance))


def contributions(runs: pd.DataFrame, arms: pd.DataFrame, cfg: AblationConfig) -> pd.DataFrame:
    """One row per (technique or pair) x metric x kind: with / without ratio (geometric mean over rounds) [95% CI], rounds,
    whether it interacts, and a note (what leaving out also removes, skipped arms and why).

    `arms` is the arm table (arm_table): which set of techniques each arm is, and why one was skipped.
    """
    by_set = {frozenset(t for t in str(row.techniques).split("+") if t and t != "nan"): row
              for row in arms.fillna("").itertuples()}
    everything = frozenset(cfg.names)

    degraded = lost_quality(runs)

    def ratio(with_set: frozenset[str], without_set: frozenset[str], metric: str) -> tuple[pd.Series, list[str]]:
        why = [f"{by_set[s].arm} skipped: {by_set[s].reason}" for s in (with_set, without_set)
               if s in by_set and by_set[s].status == "skipped"]
        why += [f"{set_name(cfg, s)} not planned" for s in (with_set, without_set) if s not in by_set]
        if why:
            return pd.Series(dtype=float), why
        arms_here = (by_set[with_set].arm, by_set[without_set].arm)
        lost = [f"{arm} {degraded[arm]}" for arm in arms_here if arm in degraded]   # the ratio is kept, with its cost
        return paired_ratios(runs, *arms_here, metric), lost

    rows = []

    def add(technique: str, metric: str, kind: str, with_set, without_set, ratios: pd.Series, notes: list[str],
            judged: bool = False) -> None:
        summary = summarise_ratios(ratios)
        rows.append({"technique": technique, "metric": metric, "kind": kind,
                     "with_arm": _arm_name(by_set, cfg, with_set), "without_arm": _arm_name(by_set, cfg, without_set),
                     **summary,
                     "interacts": judged and interacts(summary["ratio"], summary["ci_low"], summary["ci_high"],
                                                       cfg.interaction_tolerance),
                     "note": "; ".join(notes)})

    for metric in METRICS:
        ratios, why = ratio(everything, frozenset(), metric)
        add("all", metric, "full_vs_baseline", everything, frozenset(), ratios, why)
        for t in cfg.names:
            unit = cfg.unit(t)
            also = sorted(unit - {t})
            add_with, add_without = cfg.closure({t}), cfg.requirements(t)
            add_ratios, add_why = ratio(add_with, add_without, metric)
            add(t, metric, "add_one_in", add_with, add_without, add_ratios,
                add_why + ([f"over {'+'.join(cfg.ordered(add_without))} (what it requires)"] if add_without else []))
            loo_ratios, loo_why = ratio(everything, everything - unit, metric)
            add(t, metric, "leave_one_out", everything, everything - unit, loo_ratios,
                loo_why + ([f"also removes {', '.join(also)} (requires {t})"] if also else []))
            # the interaction compares like with like: adding and removing the same unit
            unit_with = cfg.closure(unit)
            unit_ratios, unit_why = ratio(unit_with, unit_with - unit, metric)
            notes = list(dict.fromkeys(loo_why + unit_why)) + (
                [f"compares adding and removing {'+'.join(cfg.ordered(unit))}"] if also else [])
            missing = loo_ratios.empty or unit_ratios.empty        # an arm skipped or not planned
            add(t, metric, "interaction", everything, everything - unit,
                pd.Series(dtype=float) if missing else loo_ratios / unit_ratios, notes, judged=True)
        for a, b in itertools.combinations(cfg.names, 2):
            pa, pb = cfg.closure({a}), cfg.closure({b})
            if pa <= pb or pb <= pa:
                continue       # nested: b requires a (or the reverse), no 2x2 square to compare
            sets = (pa | pb, pa & pb, pa, pb)
            if not all(s in by_set and by_set[s].status == "measured" for s in sets):
                continue       # not measured (experiment.ablation.pairs=true measures every pair)
            both, neither, only_a, only_b = (per_round(runs, by_set[s].arm, metric) for s in sets)
            ratios = both * neither / (only_a * only_b).where(only_a * only_b != 0)
            lost = [f"{by_set[s].arm} {degraded[by_set[s].arm]}" for s in sets if by_set[s].arm in degraded]
            add(f"{a} x {b}", metric, "pair", pa | pb, pa & pb, ratios, lost, judged=True)
    return pd.DataFrame(rows)


def lost_quality(runs: pd.DataFrame) -> dict[str, str]:
    """arm -> what it lost, for the arms the quality guardrail marked degraded (ablate.experiment.quality_guard)."""
    if "status" not in runs:
        return {}
    rows = runs[runs["status"] == "degraded"]
    out = {}
    for arm, frame in rows.groupby("arm", sort=False):
        ppl = frame["ppl_ratio"].dropna() if "ppl_ratio" in frame else pd.Series(dtype=float)
        agree = frame["token_agreement"].dropna() if "token_agreement" in frame else pd.Series(dtype=float)
        cost = [f"perplexity x{ppl.iloc[0]:.4g}"] * bool(len(ppl)) + [f"agreement {agree.median():.0%}"] * bool(len(agree))
        out[arm] = f"degraded ({', '.join(cost) or 'lost quality'})"
    return out


def _arm_name(by_set: dict[frozenset[str], Any], cfg: AblationConfig, techniques: frozenset[str]) -> str:
    return by_set[techniques].arm if techniques in by_set else set_name(cfg, techniques)
