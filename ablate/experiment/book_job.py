"""A job of experiment.kind=book (`python -m ablate book [section=7.3]`): the chapter's claims
(ablate.book), one table per section, stored and logged like an experiment's results (claims.csv,
verdicts.csv, report.md, W&B)."""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from ablate.book.claims import MEASURED, NOT_RUN, VERDICTS, claims_frame, verdict_counts
from ablate.book.config import BookConfig
from ablate.book.evidence import Evidence
from ablate.book.sections import SECTIONS, section_claims
from ablate.report.table_run import store_tables
from ablate.results import RunFolder

CONSOLE_COLUMNS = ["key", "book", "project", "verdict"]
REPORT_COLUMNS = ["key", "claim", "book", "project", "verdict", "holds", "reason", "command"]


def book_tables(config: BookConfig, evidence: Evidence) -> dict[str, pd.DataFrame]:
    """claims: one row per claim of the chosen sections; verdicts: claims per section and verdict."""
    frame = claims_frame([c for s in config.sections for c in section_claims(s, evidence)])
    counts = pd.DataFrame([{"section": s, **verdict_counts(frame[frame["section"] == s])} for s in config.sections])
    total = {"section": "all", **{v: int(counts[v].sum()) for v in VERDICTS}}
    return {"claims": frame, "verdicts": pd.concat([counts, pd.DataFrame([total])], ignore_index=True)}


def report_text(tables: dict[str, pd.DataFrame]) -> str:
    claims, verdicts = tables["claims"], tables["verdicts"]
    lines = ["# The chapter, claim by claim", "",
             "Each quantitative statement of chapter 7, in the project's words, with the book's figure, the "
             "project's and a verdict: exact (the same figure at the book's precision), rounded (within 10%), "
             "differs (the reason says why), measured (on this machine: `holds` says whether it held), "
             "not run (its chapter experiment has no finished run to read yet).", "",
             "## Verdicts", "", verdicts.to_markdown(index=False), ""]
    for section, (subject, _) in SECTIONS.items():
        rows = claims[claims["section"] == section]
        if not rows.empty:
            lines += [f"## {section}: {subject}", "", rows[REPORT_COLUMNS].to_markdown(index=False), ""]
    return "\n".join(lines)


def console_text(tables: dict[str, pd.DataFrame]) -> str:
    claims = tables["claims"]
    parts = []
    for section, (subject, _) in SECTIONS.items():
        rows = claims[claims["section"] == section]
        if not rows.empty:
            shown = rows[CONSOLE_COLUMNS].assign(project=rows["project"].str.slice(0, 60))
            parts += [f"{section}: {subject}", shown.to_string(index=False), ""]
    totals = tables["verdicts"].iloc[-1]
    parts.append("claims: " + ", ".join(f"{totals[v]} {v}" for v in VERDICTS))
    return "\n".join(parts)


def run_book_job(cfg, raw: dict[str, Any], folder: RunFolder, device: torch.device) -> None:
    """Compute, print, store like any experiment, log to W&B."""
    config = cfg.book or BookConfig()
    evidence = Evidence(config.runs_dir or cfg.results_dir, config.measure, device)
    tables = book_tables(config, evidence)
    print(console_text(tables))
    claims = tables["claims"]
    summary = {f"claims/{v}": float(n) for v, n in verdict_counts(claims).items()}
    summary["claims/measured_held"] = float(((claims["verdict"] == MEASURED) & (claims["holds"] == "yes")).sum())
    wandb_dir = store_tables(folder, experiment=cfg.experiment.name, chapter=cfg.experiment.chapter, config=raw,
                             tables=tables, report=report_text(tables), summary=summary, wandb=cfg.wandb,
                             tags=[f"section {s}" for s in config.sections])
    waiting = claims[claims["verdict"] == NOT_RUN]
    if not waiting.empty:
        print("\nnot run yet: " + "; ".join(sorted(set(waiting["command"]))))
    print(f"\nreport: {folder.path / 'report.md'}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))
