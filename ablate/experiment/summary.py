"""One row per grid point and arm: medians over the repeats, speedup vs the baseline per round with
its CI (geometric mean and t-interval of the per-round ratios, ablate.analysis.stats), the analytic
prediction, and whether the arm's figures can be trusted at all (status)."""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from ablate.analysis.stats import NOISY_CV, Interval, coefficient_of_variation, log_interval
from ablate.api.plugin import Stat

# measured columns summarised by their median over the repeats
MEDIAN_COLUMNS = (
    "duration_s", "output_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p99_ms", "tokens_per_emission", "decode_step_q1_ms", "decode_step_q4_ms",
    "peak_memory_bytes", "kv_reserved_peak_bytes", "kv_used_peak_bytes", "kv_util_mean", "mbu_decode", "mfu",
    "kv_util_at_peak", "queue_p50_ms", "queue_p99_ms", "goodput_req_s", "goodput_ttft_req_s", "ttft_slo_attained",
    "seqs_admitted_max", "seqs_admitted_mean", "seqs_admitted_while_queued", "preemptions", "kv_bytes_per_token",
    "baseline_agreement", "token_agreement", "perplexity", "ppl_ratio")
# an arm's status over its rounds: the worst one counts (degraded: lost quality, ablate.experiment.quality_guard)
STATUS_ORDER = ("ok", "degraded", "diverged", "failed", "skipped")   # skipped: an outside engine not installed
AGGREGATE = {"median": lambda v: v.median(), "max": lambda v: v.max(), "min": lambda v: v.min(),
             "first": lambda v: v.iloc[0]}


def worst_status(statuses: pd.Series) -> str:
    return max(statuses.fillna("ok"), key=STATUS_ORDER.index, default="ok")


def summarise_arms(runs: pd.DataFrame, point_keys: list[str], baseline: str,
                   stats: dict[str, Stat]) -> pd.DataFrame:
    """Per grid point and arm. An arm whose status is not "ok" (it failed, declared itself exact and
    diverged from the baseline, or lost quality) gets no speedup: its time measures something else.
    A degraded arm's time ratio is kept as `time_ratio` (with its CI), to be read with its quality cost."""
    out = []
    groups = runs.groupby(point_keys, sort=False) if point_keys else [((), runs)]
    for point, frame in groups:
        point = point if isinstance(point, tuple) else (point,)
        base = frame[(frame["arm"] == baseline) & (frame["status"] == "ok")].set_index("repeat")
        for arm, arm_frame in frame.groupby("arm", sort=False):
            arm_frame = arm_frame.set_index("repeat")
            status = worst_status(arm_frame["status"])
            row = dict(zip(point_keys, point)) | {"arm": arm, "label": arm_frame["label"].iloc[0], "status": status}
            details = [d for d in arm_frame.get("status_detail", pd.Series(dtype=object)).dropna() if d]
            row["status_detail"] = details[0] if details else ""
            ok = arm_frame[arm_frame["status"].isin(("ok", "degraded"))]     # measured as it claims to run
            if status in ("ok", "degraded") and not base.empty:
                ratios = (base["duration_s"].reindex(ok.index) / ok["duration_s"]).to_numpy(float)
                ratio = log_interval(ratios)
            else:
                ratio = Interval(np.nan, np.nan, np.nan, 0, f"arm {status}")
            if status == "degraded":
                row |= {"time_ratio": ratio.center, "time_ratio_ci_low": ratio.low, "time_ratio_ci_high": ratio.high}
                ratio = Interval(np.nan, np.nan, np.nan, ratio.n, "lost quality")
            row |= {"speedup": ratio.center, "speedup_ci_low": ratio.low, "speedup_ci_high": ratio.high,
                    "speedup_rounds": ratio.n, "speedup_note": ratio.note}
            if status in ("ok", "degraded") and "predicted_step_time_s_total" in ok and not base.empty:
                row["predicted_speedup"] = float(base["predicted_step_time_s_total"].median()
                                                 / ok["predicted_step_time_s_total"].median())
            measured = ok if not ok.empty else arm_frame
            cv = coefficient_of_variation(measured["duration_s"].to_numpy(float)) if "duration_s" in measured else np.nan
            row["duration_cv"] = cv
            row["noisy"] = bool(cv > NOISY_CV) if not np.isnan(cv) else False
            for col in MEDIAN_COLUMNS:
                if col in measured and pd.api.types.is_numeric_dtype(measured[col]):
                    row[col] = float(measured[col].median())
            if "kernel_compiles" in measured:                            # in the timed rounds
                row["kernel_compiles"] = int(measured["kernel_compiles"].fillna(0).sum())
            if "dtype" in measured:
                row["dtype"] = measured["dtype"].iloc[0]                 # the arm's resolved model.dtype
            if "finish_order" in measured:
                row["finish_order"] = measured["finish_order"].iloc[0]   # the first repeat's
            for col, stat in stats.items():        # the plugins' own figures, as each declares
                if col in measured and measured[col].notna().any():
                    value = AGGREGATE[stat.aggregate](measured[col].dropna())
                    row[col] = value if stat.unit == "text" else float(value)
            if "peak_memory_bytes" in row and not base.empty:
                row["memory_ratio"] = row["peak_memory_bytes"] / float(base["peak_memory_bytes"].median())
            out.append(row)
    summary = pd.DataFrame(out)
    for _, r in summary[summary["noisy"]].iterrows():
        warnings.warn(f"arm {r['arm']}: run-time coefficient of variation {r['duration_cv']:.0%} is above "
                      f"{NOISY_CV:.0%}: the machine was noisy, treat its figures with care", stacklevel=2)
    for _, r in summary[summary.get("kernel_compiles", pd.Series(0, index=summary.index)) > 0].iterrows():
        warnings.warn(f"arm {r['arm']}: {r['kernel_compiles']} Triton kernel variants compiled during its timed "
                      "rounds: their time includes compilation (raise experiment.warmup)", stacklevel=2)
    for _, r in summary[summary["status"] != "ok"].iterrows():
        warnings.warn(f"arm {r['arm']} {r['status']}: {r['status_detail']}", stacklevel=2)
    return summary
