"""The metrics of one run, computed from the recorder exactly as docs/what-is-measured.md defines them.

TTFT = first token time - arrival; TPOT = (E2E - TTFT) / (output tokens - 1), only for > 1 token;
ITL = gaps between a request's consecutive emissions (a multi-token emission is one);
E2E = last token time - arrival. Throughputs divide by (last finish - first arrival).
Queueing time = start of the first step that feeds the request - arrival.
Goodput = requests meeting every SLO set / duration; TTFT goodput = requests meeting the TTFT SLO
alone / duration, and TTFT SLO attainment = the fraction of requests meeting it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ablate.api.sequence import Sequence
from ablate.measure.recorder import Recorder

PERCENTILES = (50, 90, 99)


@dataclass
class ArmRun:
    """The figures of one arm on one grid point in one round: its row (summarise, roofline, its
    stats), one row per request (request_table) and its sequences, whose tokens are compared with the
    baseline's. Ablate's own arms (ablate.experiment.arm_run) and outside engines' (ablate.outside.runs)
    are measured into one alike."""

    row: dict[str, Any]
    requests: pd.DataFrame
    sequences: list[Sequence]


def request_table(rec: Recorder) -> pd.DataFrame:
    """One row per request: times in seconds relative to its arrival."""
    rows = []
    start = rec_start(rec)
    for r in rec.requests.values():
        times = [t for t, _ in r.emissions]
        first, last = (times[0], times[-1]) if times else (np.nan, np.nan)
        n_out = r.num_output_tokens
        ttft, e2e = first - r.arrival, last - r.arrival
        rows.append({
            "request_id": r.request_id,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": n_out,
            "arrival_s": r.arrival - start,
            "ttft_s": ttft,
            "queue_s": (r.first_scheduled - r.arrival) if r.first_scheduled is not None else np.nan,
            "tpot_s": (e2e - ttft) / (n_out - 1) if n_out > 1 else np.nan,
            "e2e_s": e2e,
            "itl_mean_s": float(np.mean(np.diff(times))) if len(times) > 1 else np.nan,
            "num_emissions": len(times),
            "tokens_per_emission": n_out / len(times) if times else np.nan,
            "finish_s": (r.finish - start) if r.finish is not None else np.nan,
            "finish_reason": r.finish_reason,
            "preemptions": r.num_preemptions,
        })
    return pd.DataFrame(rows)


def rec_start(rec: Recorder) -> float:
    return min((r.arrival for r in rec.requests.values()), default=0.0)


def _percentiles(prefix: str, values: np.ndarray) -> dict[str, float]:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {f"{prefix}_p{p}_ms": np.nan for p in PERCENTILES} | {f"{prefix}_mean_ms": np.nan}
    return ({f"{prefix}_p{p}_ms": float(np.percentile(values, p)) * 1e3 for p in PERCENTILES}
            | {f"{prefix}_mean_ms": float(values.mean()) * 1e3})


def _quarter_step_ms(rec: Recorder) -> dict[str, float]:
    """Mean decode-step time in the first and last quarter of the decode steps (growth check)."""
    decode = [s.end - s.start for s in rec.steps if s.num_prefill_seqs == 0]
    if len(decode) < 4:
        return {"decode_step_q1_ms": np.nan, "decode_step_q4_ms": np.nan}
    q = len(decode) // 4
    return {"decode_step_q1_ms": float(np.mean(decode[:q])) * 1e3,
            "decode_step_q4_ms": float(np.mean(decode[-q:])) * 1e3}


def kv_utilisation(rec: Recorder) -> dict[str, float]:
    """used / reserved: time-weighted over steps, and at the step of peak reservation."""
    if not rec.steps:
        return {"kv_util_mean": np.nan, "kv_util_at_peak": np.nan}
    dur = np.array([s.end - s.start for s in rec.steps])
    res = np.array([s.kv_bytes_reserved for s in rec.steps], dtype=float)
    used = np.array([s.kv_bytes_used for s in rec.steps], dtype=float)
    ok = res > 0
    if not ok.any():
        return {"kv_util_mean": np.nan, "kv_util_at_peak": np.nan}
    util = np.where(ok, used / np.where(ok, res, 1), 0)
    peak = int(np.argmax(res))
    return {"kv_util_mean": float((util * dur)[ok].sum() / dur[ok].sum()),
            "kv_util_at_peak": float(util[peak])}


def admission(rec: Recorder) -> dict[str, float]:
    """Sequences holding KV-cache room at once: peak, time-weighted mean, and time-weighted mean over
    the steps during which some request waited for its first step (then the cache or the slots, not
    the workload, set how many run: the capacity a KV budget gives)."""
    nan = {"seqs_admitted_max": np.nan, "seqs_admitted_mean": np.nan, "seqs_admitted_while_queued": np.nan}
    if not rec.steps:
        return nan
    dur = np.array([s.end - s.start for s in rec.steps])
    held = np.array([s.num_seqs_admitted for s in rec.steps], dtype=float)
    starts = np.array([s.start for s in rec.steps])
    arrivals = np.array([r.arrival for r in rec.requests.values()])
    firsts = np.array([r.first_scheduled if r.first_scheduled is not None else np.inf for r in rec.requests.values()])
    queued = ((arrivals[None, :] <= starts[:, None]) & (firsts[None, :] > starts[:, None])).any(axis=1) \
        if len(arrivals) else np.zeros(len(starts), dtype=bool)                                  # (steps,)

    def weighted(mask: np.ndarray) -> float:
        if not mask.any():
            return np.nan
        return float((held * dur)[mask].sum() / dur[mask].sum()) if dur[mask].sum() > 0 else float(held[mask].mean())

    return {"seqs_admitted_max": float(held.max()), "seqs_admitted_mean": weighted(np.ones_like(queued)),
            "seqs_admitted_while_queued": weighted(queued)}


def finish_order(rec: Recorder) -> str:
    """Request ids in the order they finished, e.g. "2 3 1 0" (the textbook case's picture)."""
    done = sorted((r.finish, r.request_id) for r in rec.requests.values() if r.finish is not None)
    return " ".join(str(request_id) for _, request_id in done)


def summarise(rec: Recorder) -> dict[str, float]:
    """One row of figures for a whole run."""
    req = request_table(rec)
    span = float(np.nanmax(req["finish_s"])) if len(req) else np.nan   # last finish - first arrival
    out_tokens = int(req["output_tokens"].sum())
    itl = np.concatenate([np.diff([t for t, _ in r.emissions]) for r in rec.requests.values()
                          if len(r.emissions) > 1] or [np.array([])])
    summary = {
        "requests": len(req),
        "output_tokens": out_tokens,
        "prompt_tokens": int(req["prompt_tokens"].sum()),
        "duration_s": span,
        "output_throughput_tok_s": out_tokens / span,
        "total_throughput_tok_s": (out_tokens + int(req["prompt_tokens"].sum())) / span,
        "request_throughput_req_s": len(req) / span,
        "tokens_per_emission": out_tokens / max(1, int(req["num_emissions"].sum())),
        "steps": len(rec.steps),
        "step_time_mean_ms": float(np.mean([s.end - s.start for s in rec.steps])) * 1e3 if rec.steps else np.nan,
        "kv_reserved_peak_bytes": max((s.kv_bytes_reserved for s in rec.steps), default=0),
        "kv_used_peak_bytes": max((s.kv_bytes_used for s in rec.steps), default=0),
        "batch_size_mean": float(np.mean([s.num_seqs for s in rec.steps])) if rec.steps else np.nan,
        "batch_size_max": max((s.num_seqs for s in rec.steps), default=0),
        "preemptions": int(req["preemptions"].sum()) if len(req) else 0,
        "finish_order": finish_order(rec),
    }
    summary |= _percentiles("ttft", req["ttft_s"].to_numpy(float))
    summary |= _percentiles("tpot", req["tpot_s"].to_numpy(float))
    summary |= _percentiles("e2e", req["e2e_s"].to_numpy(float))
    summary |= _percentiles("queue", req["queue_s"].to_numpy(float))
    summary |= _percentiles("itl", itl.astype(float))
    summary |= _quarter_step_ms(rec)
    summary |= kv_utilisation(rec)
    summary |= admission(rec)
    return summary


def goodput(requests: pd.DataFrame, ttft_slo_ms: float | None, tpot_slo_ms: float | None, duration_s: float) -> float:
    """Requests per second that meet every SLO given (TTFT and TPOT)."""
    ok = np.ones(len(requests), dtype=bool)
    if ttft_slo_ms is not None:
        ok &= requests["ttft_s"].to_numpy() * 1e3 <= ttft_slo_ms
    if tpot_slo_ms is not None:
        tpot = requests["tpot_s"].to_numpy() * 1e3
        ok &= np.isnan(tpot) | (tpot <= tpot_slo_ms)
    return float(ok.sum()) / duration_s


def ttft_slo_attainment(requests: pd.DataFrame, ttft_slo_ms: float, duration_s: float) -> dict[str, float]:
    """The TTFT SLO alone (what a user waits before the first token; TPOT not counted):

        goodput_ttft_req_s = #{requests with TTFT <= SLO} / duration
        ttft_slo_attained  = #{requests with TTFT <= SLO} / #requests

    A request that never emitted a token (TTFT NaN) misses it."""
    if ttft_slo_ms <= 0 or duration_s <= 0:
        raise ValueError(f"ttft_slo_attainment: the TTFT SLO ({ttft_slo_ms} ms) and the duration ({duration_s} s) "
                         "must be positive")
    met = int((requests["ttft_s"].to_numpy(float) * 1e3 <= ttft_slo_ms).sum())    # NaN <= x is False
    return {"goodput_ttft_req_s": met / duration_s,
            "ttft_slo_attained": met / len(requests) if len(requests) else np.nan}


def roofline(rec: Recorder, peaks) -> dict[str, float]:
    """Analytic prediction of the run's step time beside the measured one, and MBU / MFU.

    MBU = bytes moved per step / step time / peak bandwidth (decode steps only: their bytes are
    what bounds them); MFU = FLOPs / time / peak FLOP/s over all steps. Both capped at 100%
    since the peaks are measured, not theoretical.
    """
    if not rec.steps:
        return {}
    step_s = np.array([s.end - s.start for s in rec.steps])
    flops = np.array([s.flops for s in rec.steps])
    nbytes = np.array([s.bytes for s in rec.steps])
    predicted = np.maximum(flops / peaks.flops, nbytes / peaks.bandwidth_bytes_s)
    decode = np.array([s.num_prefill_seqs == 0 for s in rec.steps])
    out = {"predicted_step_time_s_total": float(predicted.sum()),
           "measured_step_time_s_total": float(step_s.sum()),
           "mfu": float(min(1.0, flops.sum() / step_s.sum() / peaks.flops))}
    out["mbu_decode"] = (float(min(1.0, (nbytes[decode] / step_s[decode]).mean() / peaks.bandwidth_bytes_s))
                         if decode.any() else np.nan)
    return out
