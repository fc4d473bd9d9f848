"""The goodput knee of a request-rate sweep: the highest rate an arm serves within its TTFT SLO.

Per arm, the rates tried go in ascending order, each with its TTFT-SLO attainment (the fraction of
requests whose TTFT met experiment.ttft_slo_ms: `ttft_slo_attained`, the median over rounds; or,
where only goodput was recorded, goodput / request rate). The knee is the highest rate whose
attainment is >= the target (experiment.knee_target) with every lower rate meeting it too: the
highest rate below the first miss. The next rate tried is the one that missed.

Attainment need not fall monotonically (arrivals are random; a run is short). A rate that meets the
target again above a miss does not move the knee: past the first miss the arm is already over its
capacity at a rate it was offered, and a recovery above it is luck of the arrivals, not capacity to
plan on (`met_above_miss` flags it). Two edges are named, never given as a knee: every rate met the
target (the knee lies above the highest rate tried: sweep higher), or even the lowest missed (it
lies below the lowest: sweep lower); knee_rate is then NaN and `knee` says which.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

# when a summary has no attainment column: requests per second that met the TTFT SLO (alone, or with the TPOT SLO)
GOODPUT_COLUMNS = ("goodput_ttft_req_s", "goodput_req_s")
KNEE_COLUMNS = ("knee_rate", "knee_attained", "missed_rate", "missed_attained", "sweep_missed", "met_above_miss",
                "highest_rate_tried", "knee")
ABOVE, BELOW, UNMEASURED = "above the highest rate tried", "below the lowest rate tried", "no attainment measured"


def _knee_of(attained_by_rate: pd.Series, target: float) -> dict[str, Any]:
    """The knee columns for one arm; `attained_by_rate`: rate -> attainment, ascending, no NaN."""
    rates = [float(r) for r in attained_by_rate.index]
    attained = [float(a) for a in attained_by_rate]
    nan = math.nan
    if not rates:
        return dict(zip(KNEE_COLUMNS, (nan, nan, nan, nan, False, False, nan, UNMEASURED)))
    miss = next((i for i, a in enumerate(attained) if a < target), None)
    if miss is None:
        return dict(zip(KNEE_COLUMNS, (nan, nan, nan, nan, False, False, rates[-1], f"{ABOVE} ({rates[-1]:g}/s)")))
    met_again = any(a >= target for a in attained[miss + 1:])
    if miss == 0:
        verdict = f"{BELOW} ({rates[0]:g}/s)"
        return dict(zip(KNEE_COLUMNS, (nan, nan, rates[0], attained[0], True, met_again, rates[-1], verdict)))
    knee = miss - 1
    return dict(zip(KNEE_COLUMNS, (rates[knee], attained[knee], rates[miss], attained[miss], True, met_again,
                                   rates[-1], f"{rates[knee]:g}/s")))


def goodput_knee(summary: pd.DataFrame, rate_col: str = "rate", attained_col: str = "ttft_slo_attained",
                 target: float = 0.9, by: tuple[str, ...] = ("arm",)) -> pd.DataFrame:
    """One row per arm (per `by` group: add other grid keys to get one per point of theirs): the knee
    (module docstring), the attainment at it, the next rate tried (which missed) and its attainment,
    whether the sweep ever missed and whether a rate met the target again above a miss. Rows of the
    same arm and rate (rounds, in a runs table) are reduced to their median attainment first."""
    if not (isinstance(target, (int, float)) and 0 < target <= 1):
        raise ValueError(f"goodput_knee: target must be a fraction in (0, 1], got {target!r}")
    missing = [c for c in (rate_col, *by) if c not in summary]
    if missing:
        raise ValueError(f"goodput_knee: the summary has no column {', '.join(missing)}; it has "
                         f"{', '.join(map(str, summary.columns))}")
    frame = summary
    if attained_col not in frame:
        goodput = next((c for c in GOODPUT_COLUMNS if c in frame), None)
        if goodput is None:
            raise ValueError(f"goodput_knee: the summary has neither {attained_col!r} nor a goodput column "
                             f"({', '.join(GOODPUT_COLUMNS)}): set experiment.ttft_slo_ms")
        frame = frame.assign(**{attained_col: frame[goodput] / frame[rate_col]})    # requests meeting it / offered
    rows = []
    for key, group in frame.groupby(list(by), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        attained = group.dropna(subset=[attained_col]).groupby(rate_col)[attained_col].median().sort_index()
        rows.append(dict(zip(by, key)) | _knee_of(attained, target) | {"target": float(target)})
    return pd.DataFrame(rows, columns=[*by, *KNEE_COLUMNS, "target"])


def report_tables(config: dict[str, Any], summary: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """{"Goodput knee": one row per arm} for a run that swept workload.rate with experiment.ttft_slo_ms
    set; {} for any other run (the book's registry of analytic tables puts it in every experiment's report
    and run folder)."""
    experiment = config.get("experiment") or {}
    grid = experiment.get("grid") or {}
    if summary is None or summary.empty or "rate" not in grid or experiment.get("ttft_slo_ms") is None:
        return {}
    others = tuple(k for k in grid if k != "rate")      # one knee per arm and point of the other grid keys
    table = goodput_knee(summary, target=float(experiment.get("knee_target", 0.9)), by=("arm", *others))
    return {"Goodput knee": table.assign(ttft_slo_ms=float(experiment["ttft_slo_ms"]))}
