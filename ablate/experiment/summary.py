"""One row per grid point and arm: medians over the repeats, speedup vs the baseline per round with
its CI (geometric mean and t-interval of the per-round ratios, ablate.analysis.stats), the analytic
prediction, and whether the arm's figures can be trusted at all (status).

A round in which other work took the CPU from the arm or the baseline (`contended`,
ablate.measure.cpu_load) gives no ratio: the speedup rests on the clean rounds alone, and an arm
with fewer than MIN_ROUNDS of them is *noisy*: its time ratio over all rounds is kept with its
interval, never called a speedup. (An arm with fewer rounds in all, none contended, keeps its
centre without an interval.)"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ablate.analysis.stats import MIN_ROUNDS, NOISY_CV, Interval, coefficient_of_variation, log_interval
from ablate.api.plugin import Stat

# measured columns summarised by their median over the repeats
MEDIAN_COLUMNS = (
    "duration_s", "output_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p99_ms", "tokens_per_emission", "decode_step_q1_ms", "decode_step_q4_ms",
    "peak_memory_bytes", "kv_reserved_peak_bytes", "kv_used_peak_bytes", "kv_util_mean", "mbu_decode", "mfu",
    "kv_util_at_peak", "queue_p50_ms", "queue_p99_ms", "goodput_req_s", "goodput_ttft_req_s", "ttft_slo_attained",
    "seqs_admitted_max", "seqs_admitted_mean", "seqs_admitted_while_queued", "preemptions", "kv_bytes_per_token",
    "baseline_agreement", "token_agreement", "perplexity", "ppl_ratio")
# counts over the timed rounds, summed: tuning inside them (Triton compiles, product-path timings, graph
# captures and their seconds) and how the decode steps ran (engine.graphs; layers as native calls)
SUMMED_COLUMNS = ("kernel_compiles", "path_timings", "engine.graph_captures", "engine.graph_capture_s",
                  "engine.graph_replays", "engine.graph_eager_steps", "engine.native_layers", "engine.one_call_layers",
                  "engine.eager_layers")
# an arm's status over its rounds: the worst one counts (noisy: too few rounds on an uncontended CPU;
# degraded: lost quality, ablate.experiment.quality_guard; skipped: an outside engine not installed)
STATUS_ORDER = ("ok", "noisy", "degraded", "diverged", "failed", "skipped")
# statuses whose time ratio is kept (with its interval), read with what it cost, never as a speedup
RATIO_ONLY = {"noisy": "contended CPU", "degraded": "lost quality"}
AGGREGATE = {"median": lambda v: v.median(), "max": lambda v: v.max(), "min": lambda v: v.min(),
             "first": lambda v: v.iloc[0]}


def worst_status(statuses: pd.Series) -> str:
    return max(statuses.fillna("ok"), key=STATUS_ORDER.index, default="ok")


def contended_rounds(frame: pd.DataFrame) -> set:
    """The repeats of `frame` (indexed by repeat) measured while other work took the CPU."""
    if "contended" not in frame:
        return set()
    return set(frame.index[frame["contended"].astype("boolean").fillna(False).to_numpy(bool)])


def clean_ratios(base: pd.DataFrame, arm: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per-round time ratios baseline / arm (both indexed by repeat): (over the rounds in which
    neither was contended, over all rounds)."""
    ratios = base["duration_s"].reindex(arm.index) / arm["duration_s"]
    clean = ratios.drop(index=list((contended_rounds(base) | contended_rounds(arm)) & set(ratios.index)))
    return clean.to_numpy(float), ratios.to_numpy(float)


def summarise_arms(runs: pd.DataFrame, point_keys: list[str], baseline: str,
                   stats: dict[str, Stat]) -> pd.DataFrame:
    """Per grid point and arm. An arm whose status is not "ok" (it failed, declared itself exact and
    diverged from the baseline, lost quality, or ran on a contended CPU) gets no speedup: its time
    measures something else. A degraded or noisy arm's time ratio is kept as `time_ratio` (with its
    CI), to be read with what it cost."""
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
                clean, every = clean_ratios(base, ok)
                row["contended_rounds"] = len(every) - len(clean)
                ratio = log_interval(clean)
                if row["contended_rounds"] and len(clean) < MIN_ROUNDS:
                    ratio = log_interval(every)
                    status = row["status"] = "noisy" if status == "ok" else status
                    row["status_detail"] = row["status_detail"] or (
                        f"other work took the CPU in {row['contended_rounds']} of {len(every)} rounds; "
                        f"{len(clean)} clean, {MIN_ROUNDS} needed: no speedup claimed")
            else:
                ratio = Interval(np.nan, np.nan, np.nan, 0, f"arm {status}")
            if status in RATIO_ONLY:
                row |= {"time_ratio": ratio.center, "time_ratio_ci_low": ratio.low, "time_ratio_ci_high": ratio.high}
                ratio = Interval(np.nan, np.nan, np.nan, ratio.n, RATIO_ONLY[status])
            row |= {"speedup": ratio.center, "speedup_ci_low": ratio.low, "speedup_ci_high": ratio.high,
                    "speedup_rounds": ratio.n, "speedup_note": ratio.note}
            if status in ("ok", *RATIO_ONLY) and "predicted_step_time_s_total" in ok and not base.empty:
                row["predicted_speedup"] = float(base["predicted_step_time_s_total"].median()
                                                 / ok["predicted_step_time_s_total"].median())
            measured = ok if not ok.empty else arm_frame
            cv = coefficient_of_variation(measured["duration_s"].to_numpy(float)) if "duration_s" in measured else np.nan
            row["duration_cv"] = cv
            row["unstable"] = bool(cv > NOISY_CV) if not np.isnan(cv) else False
            for col in MEDIAN_COLUMNS:
                if col in measured and pd.api.types.is_numeric_dtype(measured[col]):
                    row[col] = float(measured[col].median())
            for col in SUMMED_COLUMNS:                                   # over the timed rounds
                if col in measured:
                    row[col] = measured[col].fillna(0).sum()
            modes = measured["engine.graphs"].dropna() if "engine.graphs" in measured else ()
            if len(modes):
                row["engine.graphs"] = modes.iloc[-1]                    # the last round's mode
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
    return pd.DataFrame(out)

