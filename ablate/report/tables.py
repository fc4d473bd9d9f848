"""The report's tables: the summary every experiment gets, and the ones its results call for (KV
bytes per token when arms differ in it; one per heading the plugins' stats declare)."""
from __future__ import annotations

import math

import pandas as pd

from ablate.analysis.stats import NOISY_CV
from ablate.api.plugin import Stat
from ablate.report.declared import Declarations

# how the report names measured columns that a plugin's stat may predict
MEASURED_LABELS = {"kv_util_mean": "KV util", "seqs_admitted_while_queued": "seqs at once",
                   "speedup": "speedup [95% CI]"}


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _mib(n: float) -> str:
    return "-" if _missing(n) else f"{n / 2**20:,.1f}"


def _ms(x: float) -> str:
    return "-" if _missing(x) else f"{x:,.1f}"


def _fmt(spec: str, suffix: str = ""):
    """A formatter for a table cell: '-' for a missing value, else format(x, spec) + suffix."""
    return lambda x: "-" if pd.isna(x) else format(x, spec) + suffix


def _bytes(n: float) -> str:
    """A byte count in the unit that reads best: B, KiB or MiB."""
    if _missing(n):
        return "-"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _number(x: float) -> str:
    """An integer in full, other numbers to four significant digits."""
    if _missing(x):
        return "-"
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.4g}"


UNIT_FORMATS = {"": _number, "count": _number, "tokens": _fmt(",.1f"), "bytes": _bytes, "ms": _ms,
                "ratio": _fmt(".3f"), "fraction": _fmt(".0%"), "x": _fmt(".2f", "x"),
                "text": lambda x: "-" if pd.isna(x) else str(x)}


UNIT_LABELS = {"ms": " (ms)", "tokens": " (tokens)"}


def format_stat(stat: Stat):
    return UNIT_FORMATS[stat.unit]


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series([math.nan] * len(frame), index=frame.index)


def speedup_text(row: pd.Series, short: bool = False) -> str:
    """'1.87x [1.80, 1.95]'; with no interval (under 3 rounds) '1.87x [n/a: <why>]', or with `short`
    '1.87x [n/a]'; no speedup: '-' for an ok arm, its status for a failed one ('n/a' with `short`),
    and for a degraded arm (it lost quality) or a noisy one (other work took the CPU) its time ratio
    marked as such."""
    if pd.isna(row.get("speedup")):
        ratio = row.get("time_ratio")
        if row.get("status") in ("degraded", "noisy") and not _missing(ratio) and not pd.isna(ratio):
            # its time, read with what it cost, never as a speedup of the same output on the same machine
            status = str(row["status"]).upper()
            if short:
                return f"{status} ({ratio:.2f}x time)"
            low, high = row.get("time_ratio_ci_low", math.nan), row.get("time_ratio_ci_high", math.nan)
            bounds = f" [{low:.2f}, {high:.2f}]" if not (_missing(low) or _missing(high)) else ""
            return f"{status}: {ratio:.2f}x{bounds} time, not a speedup"
        if short:
            return "n/a"
        return "-" if row.get("status", "ok") == "ok" else str(row["status"]).upper()
    low, high = row.get("speedup_ci_low", math.nan), row.get("speedup_ci_high", math.nan)
    if _missing(low) or _missing(high) or pd.isna(low) or pd.isna(high):
        note = row.get("speedup_note")
        bounds = "n/a" if short or not isinstance(note, str) or not note else f"n/a: {note}"
    else:
        bounds = f"{low:.2f}, {high:.2f}"
    return f"{row['speedup']:.2f}x [{bounds}]"


def summary_table(summary: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame:
    """The columns a reader wants first: speedup with CI, prediction, throughput, latency, memory."""
    table = pd.DataFrame({
        **{k: summary[k] for k in point_keys},
        "arm": summary["arm"],
        "speedup [95% CI]": summary.apply(speedup_text, axis=1),
        "predicted": _column(summary, "predicted_speedup").map(_fmt(".2f", "x")),
        "tok/s": _column(summary, "output_throughput_tok_s").map(_fmt(",.1f")),
        "TTFT p50 ms": _column(summary, "ttft_p50_ms").map(_ms),
        "TPOT p50 ms": _column(summary, "tpot_p50_ms").map(_ms),
        "step q1->q4 ms": [f"{_ms(a)} -> {_ms(b)}" for a, b in zip(_column(summary, "decode_step_q1_ms"),
                                                                   _column(summary, "decode_step_q4_ms"))],
        "peak mem MiB": _column(summary, "peak_memory_bytes").map(_mib),
        "KV reserved MiB": _column(summary, "kv_reserved_peak_bytes").map(_mib),
        "KV util": _column(summary, "kv_util_mean").map(_fmt(".0%")),
        "CV": _column(summary, "duration_cv").map(_fmt(".1%")),
    })
    return table.assign(**_serving_columns(summary), **_status_column(summary))


def _status_column(summary: pd.DataFrame) -> dict[str, list[str]]:
    """Which arms failed or diverged, and why: shown whenever one did."""
    status = _column(summary, "status").astype(object).fillna("ok")
    if (status == "ok").all():
        return {}
    detail = _column(summary, "status_detail").astype(object).fillna("")
    return {"status": [s if s == "ok" else f"{s.upper()}: {d}" for s, d in zip(status, detail)]}


def _serving_columns(summary: pd.DataFrame) -> dict[str, list[str]]:
    """Tail latency, queueing, goodput and preemptions where arms differ in their scheduler or one
    preempted; goodput and attainment under the TTFT SLO alone where one is set; and the order
    requests finished in when arms differ in it on a small workload (the textbook case)."""
    columns: dict[str, list[str]] = {}
    schedulers_differ = _column(summary, "label").fillna("").str.contains("scheduler=").any()
    preempted = (_column(summary, "preemptions").fillna(0) > 0).any()
    if schedulers_differ or preempted or "goodput_req_s" in summary:
        columns |= {"TTFT p99 ms": _column(summary, "ttft_p99_ms").map(_ms).tolist(),
                    "TPOT p99 ms": _column(summary, "tpot_p99_ms").map(_ms).tolist(),
                    "queue p99 ms": _column(summary, "queue_p99_ms").map(_ms).tolist(),
                    "goodput req/s": _column(summary, "goodput_req_s").map(_fmt(".2f")).tolist(),
                    "preempted": _column(summary, "preemptions").map(_fmt(".0f")).tolist()}
    if "goodput_ttft_req_s" in summary:      # a TTFT SLO is set: requests that met it alone, and their share
        columns |= {"TTFT-SLO goodput req/s": summary["goodput_ttft_req_s"].map(_fmt(".2f")).tolist(),
                    "TTFT SLO met": _column(summary, "ttft_slo_attained").map(_fmt(".0%")).tolist()}
    orders = summary["finish_order"] if "finish_order" in summary else pd.Series(dtype=object)
    if orders.nunique() > 1 and orders.map(lambda o: isinstance(o, str) and len(o.split()) <= 8).all():
        columns["finish order"] = orders.tolist()
    return columns


def plugin_tables(frame: pd.DataFrame, point_keys: list[str], declared: Declarations) -> dict[str, pd.DataFrame]:
    """One table per heading the plugins' stats name, over the arms that report them. A stat that
    predicts a measured column is shown beside it: "measured (predicted)"."""
    headings: dict[str, list[tuple[str, Stat]]] = {}
    for column, stat in declared.stats.items():
        if stat.table and column in frame and frame[column].notna().any():
            headings.setdefault(stat.table, []).append((column, stat))
    tables = {}
    for heading, columns in headings.items():
        rows = frame[frame[[c for c, _ in columns]].notna().any(axis=1)]
        table = pd.DataFrame({**{k: rows[k] for k in point_keys}, "arm": rows["arm"]})
        for column, stat in columns:
            label = stat.key + UNIT_LABELS.get(stat.unit, "")
            values = rows[column].map(format_stat(stat))
            measured = stat.predicts
            if measured and measured in rows:
                shown = (rows.apply(speedup_text, axis=1) if measured == "speedup"
                         else rows[measured].map(_measured_format(measured, declared)))
                measured_label = declared.stats[measured].key if measured in declared.stats else measured
                label = f"{MEASURED_LABELS.get(measured, measured_label)} (predicted)"
                values = [f"{m} ({p})" for m, p in zip(shown, values)]
            table[label] = list(values)
        tables[heading] = table
    return tables


def _measured_format(column: str, declared: Declarations):
    if column in declared.stats:
        return format_stat(declared.stats[column])
    return _fmt(".0%") if column.startswith("kv_util") else _fmt(",.1f")


def kv_table(frame: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame | None:
    """KV bytes per token, what the cache held and how many sequences it admitted, when the arms'
    bytes per token differ (GQA, MQA, MLA, a compressed cache: the memory/concurrency/quality trade)."""
    per_token = _column(frame, "kv_bytes_per_token")
    if per_token.isna().all() or per_token.nunique() < 2:
        return None
    table = pd.DataFrame({
        **{k: frame[k] for k in point_keys},
        "arm": frame["arm"],
        "KV bytes / token": per_token.map(_fmt(",.0f")),
        "KV reserved MiB": _column(frame, "kv_reserved_peak_bytes").map(_mib),
        "seqs at once (peak)": _column(frame, "seqs_admitted_max").map(_fmt(",.1f")),
        "memory ratio": _column(frame, "memory_ratio").map(_fmt(".2f")),
    })
    if not _column(frame, "perplexity").isna().all():
        table["perplexity"] = _column(frame, "perplexity").map(_fmt(".3f"))
    return table


def summary_notes(summary: pd.DataFrame, point_keys: list[str]) -> list[str]:
    """One line for each thing a reader of the summary must know: an arm that is not ok and why, an arm
    some of whose rounds ran while other work took the CPU, one whose times varied more than NOISY_CV
    across rounds, one with tuning or capture in its time, how an arm asking for engine.graphs ran its
    decode steps; each names its grid point by `point_keys`."""
    notes = []
    for _, r in summary.iterrows():
        where = " ".join(f"{k}={r[k]}" for k in point_keys)
        arm = f"{r['arm']}{' at ' + where if where else ''}"
        contended = r.get("contended_rounds", 0)
        if r.get("status", "ok") != "ok":
            notes.append(f"{arm}: {str(r['status']).upper()}: {r.get('status_detail', '')}")
        elif not _missing(contended) and contended > 0:
            notes.append(f"{arm}: {int(contended)} round(s) ran while other work took the CPU; its speedup rests "
                         f"on the other {int(r['speedup_rounds'])}")
        if bool(r.get("unstable", False)) and r.get("status", "ok") == "ok":
            notes.append(f"{arm}: run times varied {r['duration_cv']:.0%} between rounds (above {NOISY_CV:.0%}): "
                         "its interval is wide")
        notes += [f"{arm}: {note}" for note in (_tuning_note(r), _graphs_note(r)) if note]
    return notes


def _count(r: pd.Series, col: str) -> float:
    value = r.get(col, 0)
    return 0 if _missing(value) else value


def _tuning_note(r: pd.Series) -> str:
    """What was tuned or captured inside the arm's timed rounds (its time includes it), or ""."""
    tuned = [f"{int(n)} {what}" for n, what in ((_count(r, "kernel_compiles"), "Triton kernel variants compiled"),
                                                (_count(r, "path_timings"), "CPU product paths timed")) if n > 0]
    captured = ([f"{int(r['engine.graph_captures'])} CUDA graphs captured ({_count(r, 'engine.graph_capture_s'):.3f}"
                 " s: every round builds its arm afresh)"] if _count(r, "engine.graph_captures") > 0 else [])
    if not tuned + captured:
        return ""
    return "its timed rounds include " + ", ".join(tuned + captured) + (" (raise experiment.warmup)" if tuned else "")


def _graphs_note(r: pd.Series) -> str:
    """How the decode steps of an arm that asked for engine.graphs ran, or "" for one that did not."""
    mode = r.get("engine.graphs")
    if not isinstance(mode, str) or mode == "eager":
        return ""
    if mode.startswith("eager"):
        return f"engine.graphs asked for, decode steps ran {mode}"
    how = "replayed from CUDA graphs" if mode == "cuda-graphs" else "ran compiled (engine.graphs on a CPU)"
    return (f"{int(_count(r, 'engine.graph_replays'))} steps {how}, {int(_count(r, 'engine.graph_eager_steps'))} "
            "eagerly (prompts, drafts)")
