"""The printed and Markdown report of one experiment."""
from __future__ import annotations

import math

import pandas as pd


def _mib(n: float) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / 2**20:,.1f}"


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.1f}"


def speedup_text(row: pd.Series) -> str:
    if pd.isna(row.get("speedup")):
        return "-"
    return f"{row['speedup']:.2f}x [{row['speedup_ci_low']:.2f}, {row['speedup_ci_high']:.2f}]"


def summary_table(summary: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame:
    """The columns a reader wants first: speedup with CI, prediction, throughput, latency, memory."""
    table = pd.DataFrame({
        **{k: summary[k] for k in point_keys},
        "arm": summary["arm"],
        "speedup [95% CI]": summary.apply(speedup_text, axis=1),
        "predicted": summary.get("predicted_speedup", pd.Series(dtype=float)).map(
            lambda x: "-" if pd.isna(x) else f"{x:.2f}x"),
        "tok/s": summary["output_throughput_tok_s"].map(lambda x: f"{x:,.1f}"),
        "TTFT p50 ms": summary.get("ttft_p50_ms", pd.Series(dtype=float)).map(_ms),
        "TPOT p50 ms": summary.get("tpot_p50_ms", pd.Series(dtype=float)).map(_ms),
        "step q1->q4 ms": [f"{_ms(a)} -> {_ms(b)}" for a, b in zip(
            summary.get("decode_step_q1_ms", [math.nan] * len(summary)),
            summary.get("decode_step_q4_ms", [math.nan] * len(summary)))],
        "peak mem MiB": summary["peak_memory_bytes"].map(_mib),
        "KV reserved MiB": summary.get("kv_reserved_peak_bytes", pd.Series(dtype=float)).map(_mib),
        "KV util": summary.get("kv_util_mean", pd.Series(dtype=float)).map(
            lambda x: "-" if pd.isna(x) else f"{x:.0%}"),
        "CV": summary["duration_cv"].map(lambda x: "-" if pd.isna(x) else f"{x:.1%}"),
    })
    return table


def markdown(title: str, summary: pd.DataFrame, point_keys: list[str], notes: list[str]) -> str:
    table = summary_table(summary, point_keys)
    lines = [f"# {title}", "", table.to_markdown(index=False), ""]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"

