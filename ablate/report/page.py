"""The printed and Markdown report of one experiment."""
from __future__ import annotations

import math
from pathlib import Path

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
    return table.assign(**_paging_columns(summary), **_serving_columns(summary))


def _pct(x: float) -> str:
    return "-" if pd.isna(x) else f"{x:.0%}"


def _num(x: float) -> str:
    return "-" if pd.isna(x) else f"{x:,.1f}"


def _fmt(spec: str, suffix: str = ""):
    """A formatter for a table cell: '-' for a missing value, else format(x, spec) + suffix."""
    return lambda x: "-" if pd.isna(x) else format(x, spec) + suffix


def _column(summary: pd.DataFrame, name: str) -> pd.Series:
    return summary[name] if name in summary else pd.Series([math.nan] * len(summary), index=summary.index)


def _paging_columns(summary: pd.DataFrame) -> dict[str, list[str]]:
    """Measured (predicted) KV utilisation, sequences held at once and slots wasted per sequence, for
    arms whose cache reports the paging model's prediction (ablate/paging_model.py), when the arms'
    caches differ in it (an experiment over schedulers with one cache does not need them)."""
    predicted = _column(summary, "kv_cache.predicted_kv_util")
    if predicted.isna().all() or predicted.round(6).nunique(dropna=False) < 2:
        return {}
    def pair(measured: str, predicted: str, fmt) -> list[str]:
        return [f"{fmt(m)} ({fmt(p)})" for m, p in zip(_column(summary, measured), _column(summary, predicted))]
    return {"KV util (pred)": pair("kv_util_mean", "kv_cache.predicted_kv_util", _pct),
            "seqs at once (pred)": pair("seqs_admitted_while_queued", "kv_cache.predicted_seqs_admitted", _num),
            "peak seqs": _column(summary, "seqs_admitted_max").map(_num).tolist(),
            "waste/seq (pred)": pair("kv_cache.kv_frag_slots_per_seq_mean", "kv_cache.predicted_frag_slots_per_seq",
                                     _num)}


def _serving_columns(summary: pd.DataFrame) -> dict[str, list[str]]:
    """Tail latency, queueing, goodput and preemptions where a scheduler that can preempt ran, and the
    order requests finished in when arms differ in it on a small workload (the textbook case)."""
    columns: dict[str, list[str]] = {}
    if not _column(summary, "scheduler.preemptions").isna().all():
        columns |= {"TTFT p99 ms": _column(summary, "ttft_p99_ms").map(_ms).tolist(),
                    "TPOT p99 ms": _column(summary, "tpot_p99_ms").map(_ms).tolist(),
                    "queue p99 ms": _column(summary, "queue_p99_ms").map(_ms).tolist(),
                    "goodput req/s": _column(summary, "goodput_req_s").map(
                        lambda x: "-" if pd.isna(x) else f"{x:.2f}").tolist(),
                    "preempted": _column(summary, "preemptions").map(
                        lambda x: "-" if pd.isna(x) else f"{x:.0f}").tolist()}
    orders = summary["finish_order"] if "finish_order" in summary else pd.Series(dtype=object)
    if orders.nunique() > 1 and orders.map(lambda o: isinstance(o, str) and len(o.split()) <= 8).all():
        columns["finish order"] = orders.tolist()
    return columns


def speculative_table(summary: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame | None:
    """Per speculative arm: k, acceptance, tokens per target pass, cost ratio and both speedups."""
    if "decoding.k" not in summary or summary["decoding.k"].isna().all():
        return None
    spec = summary[summary["decoding.k"].notna()]
    return pd.DataFrame({
        **{k: spec[k] for k in point_keys},
        "arm": spec["arm"],
        "drafter": spec["decoding.drafter"] if "decoding.drafter" in spec else "-",
        "k": spec["decoding.k"].map(_fmt(".0f")),
        "alpha": _column(spec, "decoding.alpha").map(_fmt(".3f")),
        "accepted / proposed": _column(spec, "decoding.acceptance_rate").map(_pct),
        "tokens / target pass": _column(spec, "decoding.tokens_per_target_forward").map(_fmt(".2f")),
        "cost ratio c": _column(spec, "decoding.cost_ratio").map(_fmt(".3f")),
        "predicted (alpha, c)": _column(spec, "decoding.predicted_speedup").map(_fmt(".2f", "x")),
        "measured [95% CI]": spec.apply(speedup_text, axis=1),
    })


def kv_table(frame: pd.DataFrame, point_keys: list[str]) -> pd.DataFrame | None:
    """KV bytes per token, what the cache held and how many sequences it admitted, when the arms'
    bytes per token differ (GQA, MQA, MLA: the memory/concurrency/quality trade)."""
    per_token = _column(frame, "kv_bytes_per_token")
    if per_token.isna().all() or per_token.nunique() < 2:
        return None
    table = pd.DataFrame({
        **{k: frame[k] for k in point_keys},
        "arm": frame["arm"],
        "KV bytes / token": per_token.map(_fmt(",.0f")),
        "KV reserved MiB": _column(frame, "kv_reserved_peak_bytes").map(_mib),
        "seqs at once (peak)": _column(frame, "seqs_admitted_max").map(_num),
        "memory ratio": _column(frame, "memory_ratio").map(_fmt(".2f")),
    })
    if not _column(frame, "perplexity").isna().all():
        table["perplexity"] = _column(frame, "perplexity").map(_fmt(".3f"))
    return table


def noise_notes(summary: pd.DataFrame, point_keys: list[str]) -> list[str]:
    """One warning per arm and point whose run times varied more than NOISY_CV across repeats."""
    from ablate.analysis.stats import NOISY_CV

    notes = []
    for _, row in summary[summary.get("noisy", pd.Series(False, index=summary.index)).astype(bool)].iterrows():
        where = " ".join(f"{k}={row[k]}" for k in point_keys)
        notes.append(f"**warning**: arm {row['arm']}{' at ' + where if where else ''}: run-time CV "
                     f"{row['duration_cv']:.0%} is above {NOISY_CV:.0%}; the machine was noisy, treat it with care")
    return notes


def markdown(title: str, summary: pd.DataFrame, point_keys: list[str], notes: list[str],
             figures: dict[str, Path] | None = None, runs: pd.DataFrame | None = None) -> str:
    """The report page: the summary table, the tables the results call for, notes, then the figures."""
    from ablate.report.plots import caption, with_run_columns

    frame = with_run_columns(summary, runs, point_keys)
    lines = [f"# {title}", "", summary_table(summary, point_keys).to_markdown(index=False), ""]
    for heading, table in (("Speculative decoding", speculative_table(frame, point_keys)),
                           ("KV bytes, memory and admission", kv_table(frame, point_keys))):
        if table is not None:
            lines += [f"## {heading}", "", table.to_markdown(index=False), ""]
    lines += [f"- {n}" for n in [*notes, *noise_notes(summary, point_keys)]]
    if figures:
        lines += ["", "## Figures", ""]
        for name, path in figures.items():
            lines += [f"![{name}]({path.name})", "", f"*{caption(name)}*", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: Path, summary: pd.DataFrame, point_keys: list[str], title: str,
                 notes: list[str], runs: pd.DataFrame | None = None) -> tuple[Path, dict[str, Path]]:
    """report.md and its PNG figures in the run folder; returns the report and the figures.

    `runs` (one row per repeat) adds what the summary lacks: throughput CIs, KV bytes per token,
    the drafter of speculative arms."""
    from ablate.report.ablation import section as ablation_section
    from ablate.report.plots import draw
    from ablate.results import write_atomic

    figures = draw(summary, point_keys, run_dir, runs)
    ablation_text, ablation_figures = ablation_section(run_dir, runs)   # "" and {} unless an ablation
    write_atomic(run_dir / "report.md", markdown(title, summary, point_keys, notes, figures, runs) + ablation_text)
    return run_dir / "report.md", figures | ablation_figures


def main(argv: list[str] | None = None) -> None:
    """python -m ablate.report.page <results path>: (re)write report.md and figures of each run below it."""
    import argparse
    import json

    from ablate.results import load, runs_under

    parser = argparse.ArgumentParser(prog="python -m ablate.report.page", description=main.__doc__)
    parser.add_argument("path", help="a run folder, or a folder holding run folders (e.g. results/)")
    args = parser.parse_args(argv)
    runs = runs_under(args.path)
    if not runs:
        raise SystemExit(f"no finished runs under {args.path} (a run folder holds done.json)")
    for run_dir in runs:
        res = load(run_dir)
        if res.summary.empty:   # a table job (cost calculator, micro-benchmark) writes its own report
            print(f"{run_dir}: no summary.csv (not an experiment run), its report.md is left as it is")
            continue
        exp = res.config.get("experiment", {})
        point_keys = list(exp.get("grid") or {})
        notes = [f"regenerated from {run_dir}", json.dumps(json.loads((run_dir / 'done.json').read_text()))]
        report, _ = write_report(run_dir, res.summary, point_keys, exp.get("name", run_dir.parent.name), notes,
                                 res.runs)
        print(report)


