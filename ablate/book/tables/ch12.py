"""Chapter 12's tables: the n x n attention scores in memory at the run's lengths and 32k, with the
bytes attention moves (ablate.analysis.score_memory), and on-chip SRAM against off-chip memory per
GPU and on this machine, measured now (ablate.analysis.onchip, ~0.5 s).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ablate.analysis.onchip import cache_levels, measure_this_machine, onchip_table
from ablate.analysis.score_memory import score_memory_table

SCORE_MEMORY_HEADING = "Attention scores (n x n) in memory, and the bytes attention moves"
ONCHIP_HEADING = "On-chip SRAM against off-chip memory"


def analytic_tables(config: dict[str, Any], summary: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """{SCORE_MEMORY_HEADING: one row per length, ONCHIP_HEADING: one row per device and this machine}."""
    levels = cache_levels()
    return {SCORE_MEMORY_HEADING: score_memory_table(config, summary),
            ONCHIP_HEADING: onchip_table(measure_this_machine(levels), levels)}
