"""The analytic tables an experiment prints beside what it measured: the registry the book fills,
which the report and the jobs read through `analytic_tables(config, summary)`.

A chapter names its table modules here (ablate/book/tables/ch<NN>.py), looked up by the run's
experiment.chapter, and any experiment gets those of EVERY_EXPERIMENT, which return {} unless its
config calls for them (the goodput knee of a rate sweep under a TTFT SLO). Each takes the run's
resolved config (the dict stored as config.json) and its summary (one row per grid point and arm,
or None before one exists) and returns {heading: table}. The report shows them after the measured
tables, the run folder keeps each as analytic_<slug>.csv and W&B logs them, so
`python -m ablate.report` can redraw them from the folder alone.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from importlib import import_module
from typing import Any

import pandas as pd

TableMaker = Callable[[dict[str, Any], "pd.DataFrame | None"], dict[str, pd.DataFrame]]

# chapter -> "module:function" (imported when the chapter's report is written)
CHAPTER_TABLES: dict[str, list[str]] = {
    "ch08": ["ablate.book.tables.ch08:analytic_tables"],     # recompute arithmetic beside the measured ratios
    "ch12": ["ablate.book.tables.ch12:analytic_tables"],     # score memory; on-chip against off-chip memory
    "ch13": ["ablate.book.tables.ch13:analytic_tables",      # KV bytes per token beside perplexity
             "ablate.book.tables.ch13_kv_bytes:analytic_tables"],   # ... measured, predicted and MHA's
}
# for every experiment, whatever its chapter: each returns {} for a run it has nothing to say about
EVERY_EXPERIMENT: list[str] = ["ablate.analysis.knee:report_tables"]


def _maker(path: str) -> TableMaker:
    module, name = path.split(":")
    return getattr(import_module(module), name)


def analytic_tables(config: dict[str, Any], summary: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """{heading: table} for the run's chapter (experiment.chapter) and those every experiment gets
    when its config calls for them; {} when none applies."""
    chapter = (config.get("experiment") or {}).get("chapter") or ""
    tables: dict[str, pd.DataFrame] = {}
    for path in [*CHAPTER_TABLES.get(chapter, []), *EVERY_EXPERIMENT]:
        tables |= _maker(path)(config, summary)
    return tables


def table_name(heading: str) -> str:
    """The run folder's file stem for a table: analytic_<heading as a slug>."""
    return "analytic_" + re.sub(r"[^a-z0-9]+", "_", heading.lower()).strip("_")
