"""A run whose baseline arm was not measured compared nothing: every speedup, saving and quality
figure is relative to the baseline. Such a run still finishes (its rows and the reasons are kept),
and done.json says so, so that the CLI exits non-zero for it (and a sweep lists its job as failed),
when it runs and when a later run skips it as finished."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

KEY = "baseline_failed"           # in done.json: why the baseline arm was not measured
UNMEASURED = ("failed", "skipped")


def baseline_failure(summary: pd.DataFrame, baseline: str) -> str | None:
    """Why the baseline arm was not measured, in one line (its first grid point that lacks it); None when it was."""
    if summary.empty or "status" not in summary:
        return None
    rows = summary[(summary["arm"] == baseline) & summary["status"].isin(UNMEASURED)]
    if rows.empty:
        return None
    detail = str(rows["status_detail"].iloc[0]) if "status_detail" in rows else ""
    return (f"the baseline arm {baseline!r} {rows['status'].iloc[0]}" + (f" ({detail})" if detail else "")
            + ": no arm could be compared with it")


def recorded_baseline_failure(run_folder: Path) -> str | None:
    """What done.json in `run_folder` says of a failed baseline; None when it says nothing (or is absent)."""
    try:
        done = json.loads((Path(run_folder) / "done.json").read_text())
    except (OSError, ValueError):
        return None
    return done.get(KEY) if isinstance(done, dict) else None
