"""The report of one experiment: report.md with its tables and PNG figures, in the run folder."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ablate.report.declared import Declarations
from ablate.report.tables import kv_table, plugin_tables, summary_notes, summary_table


def markdown(title: str, summary: pd.DataFrame, point_keys: list[str], notes: list[str],
             figures: dict[str, Path] | None = None, runs: pd.DataFrame | None = None,
             declared: Declarations | None = None, analytic: dict[str, pd.DataFrame] | None = None) -> str:
    """The report page: the summary table, the tables the results call for, the experiment's analytic
    tables (`analytic`: those the book registers for it), notes, then the figures."""
    from ablate.report.plots import caption, with_run_columns

    declared = declared or Declarations()
    frame = with_run_columns(summary, runs, point_keys)
    lines = [f"# {title}", "", summary_table(summary, point_keys).to_markdown(index=False), ""]
    tables = plugin_tables(frame, point_keys, declared)
    if (kv := kv_table(frame, point_keys)) is not None:
        tables["KV bytes, memory and admission"] = kv
    tables |= analytic or {}
    for heading, table in tables.items():
        lines += [f"## {heading}", "", table.to_markdown(index=False), ""]
    lines += [f"- {n}" for n in [*notes, *summary_notes(summary, point_keys)]]
    if figures:
        lines += ["", "## Figures", ""]
        for name, path in figures.items():
            lines += [f"![{name}]({path.name})", "", f"*{caption(name, declared)}*", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: Path, summary: pd.DataFrame, point_keys: list[str], title: str,
                 notes: list[str], runs: pd.DataFrame | None = None,
                 declared: Declarations | None = None, ttft_slo_ms: float | None = None,
                 tpot_slo_ms: float | None = None,
                 analytic: dict[str, pd.DataFrame] | None = None) -> tuple[Path, dict[str, Path]]:
    """report.md and its PNG figures in the run folder; returns the report and the figures.

    `runs` (one row per round) adds what the summary lacks (CIs of throughput, latency, goodput);
    `declared` says how to show the plugins' stats and which figures they call for; the SLOs
    (experiment.ttft_slo_ms, tpot_slo_ms) set are drawn on the latency figure; `analytic` holds the
    experiment's computed tables, shown after the measured ones."""
    from ablate.report.ablation import section as ablation_section
    from ablate.report.plots import draw
    from ablate.results import write_atomic

    declared = declared or Declarations()
    figures = draw(summary, point_keys, run_dir, runs, declared, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    ablation_text, ablation_figures = ablation_section(run_dir, runs)   # "" and {} unless an ablation
    page = markdown(title, summary, point_keys, notes, figures, runs, declared, analytic)
    write_atomic(run_dir / "report.md", page + ablation_text)
    return run_dir / "report.md", figures | ablation_figures


def main(argv: list[str] | None = None) -> None:
    """python -m ablate.report <results path>: (re)write report.md and figures of each run below it."""
    import argparse

    from ablate.book.chapter_tables import analytic_tables
    from ablate.report.compare import RunUnreadable, load_readable
    from ablate.results import runs_under

    parser = argparse.ArgumentParser(prog="python -m ablate.report", description=main.__doc__)
    parser.add_argument("path", help="a run folder, or a folder holding run folders (e.g. results/)")
    args = parser.parse_args(argv)
    runs = runs_under(args.path)
    if not runs:
        raise SystemExit(f"no finished runs under {args.path} (a run folder holds done.json)")
    errors = []
    for run_dir in runs:
        try:
            res = load_readable(run_dir)
        except RunUnreadable as err:
            errors.append(str(err))
            print(f"error: {err}")
            continue
        if res.summary.empty:
            summary = run_dir / "summary.csv"
            if summary.exists() or not res.runs.empty:   # an experiment run whose summary.csv was cut short
                errors.append(f"{summary}: truncated or empty ({summary.stat().st_size if summary.exists() else 0} "
                              "bytes, no rows), although the run finished: re-run its config with redo=true")
                print(f"error: {errors[-1]}")
            else:   # a table job (cost calculator, micro-benchmark) writes its own report
                print(f"{run_dir}: no summary.csv (not an experiment run), its report.md is left as it is")
            continue
        exp = res.config.get("experiment", {})
        point_keys = list(exp.get("grid") or {})
        notes = [f"regenerated from {run_dir}", (run_dir / "done.json").read_text().strip()]
        report, _ = write_report(run_dir, res.summary, point_keys, exp.get("name", run_dir.parent.name), notes,
                                 res.runs, Declarations.load(run_dir), ttft_slo_ms=exp.get("ttft_slo_ms"),
                                 tpot_slo_ms=exp.get("tpot_slo_ms"),
                                 analytic=analytic_tables(res.config, res.summary))
        print(report)
    if errors:
        raise SystemExit(f"{len(errors)} of {len(runs)} runs could not be reported: {errors[0]}"
                         + (" (and more above)" if len(errors) > 1 else ""))
