"""7.2: decoding without a cache recomputes the whole prefix at every step.

The arithmetic is ablate.analysis.recompute's (positions fed, FLOPs split into projections and
attention scores); the measured side is ch08's recompute curve (its analytic table sets the two
side by side for every grid point).
"""
from __future__ import annotations

import math

from ablate.analysis import recompute as arithmetic
from ablate.book.claims import Claim, checked, computed, measured, not_run
from ablate.book.tables.ch08 import analytic_tables
from ablate.model.presets import preset

SECTION = "7.2"
BOOK = "python -m ablate book section=7.2"
CH08 = "python -m ablate +experiment=ch08_kv_cache"
REPLY = 1000
LONGEST = 4096              # the longest dialogue the section discusses


def claims(evidence) -> list[Claim]:
    recomputed = arithmetic.recomputed_positions(REPLY)
    return [
        computed(SECTION, "recompute-1000", "A 1000-token reply without a cache recomputes 1 + 2 + ... + 999 "
                 "positions", 500_000, "about 500,000", recomputed, f"{recomputed:,}", 6, BOOK,
                 f"{arithmetic.positions_without_cache(REPLY):,} positions fed in all against "
                 f"{arithmetic.positions_with_cache(REPLY):,} with a cache"),
        _quadratic(),
        computed(SECTION, "doubling-4x", "Doubling the length quadruples the work", 4, "4x",
                 arithmetic.doubling_ratio(REPLY), f"{arithmetic.doubling_ratio(REPLY):.3f}x", 1, BOOK,
                 "4 - 2 / (n + 1) for the projections' positions"),
        computed(SECTION, "4096-vs-1000", "A 4096-token dialogue costs ~16x a 1000-token one", 16, "about 16x",
                 arithmetic.length_ratio(4096, REPLY), f"{arithmetic.length_ratio(4096, REPLY):.1f}x", 2, BOOK,
                 "4096 x 4097 / (1000 x 1001)"),
        _measured_growth(evidence),
    ]


def _quadratic() -> Claim:
    """O(L^2) holds for the projections; the attention scores are O(L^3) and win past n*."""
    crossings = {name: arithmetic.attention_crossover_len(preset(name)) for name in ("smollm2-135m", "llama-2-7b")}
    return checked(SECTION, "quadratic-total", "Without a cache the total work is O(L^2)", "O(L^2)",
                   "projections O(L^2), attention scores O(L^3); attention dominates past "
                   + ", ".join(f"{math.floor(n):,} tokens ({name})" for name, n in crossings.items()),
                   min(crossings.values()) > LONGEST,
                   f"quadratic up to the {LONGEST} tokens the section discusses; cubic beyond the crossover", BOOK)


def _measured_growth(evidence) -> Claim:
    key, claim, book = "recompute-growth-here", "Recompute time grows as the arithmetic says", "4x per doubling"
    run = evidence.run("ch08_kv_cache")
    if run is None:
        return not_run(SECTION, key, claim, book, CH08, "the no-cache curve over output lengths")
    table = next(iter(analytic_tables(run.config, run.summary).values()))
    rows = table.dropna(subset=["no-cache growth (meas)", "no-cache growth (pred)"])
    if rows.empty:
        return not_run(SECTION, key, claim, book, CH08, "more than one output length (the stored run has one)")
    pairs = [(int(r["output"]), r["no-cache growth (meas)"], r["no-cache growth (pred)"]) for _, r in rows.iterrows()]
    close = all(abs(m / p - 1) <= 0.25 for _, m, p in pairs)
    return measured(SECTION, key, claim, book, "; ".join(f"to {n} tokens: {m:.2f}x (predicted {p:.2f}x)"
                                                         for n, m, p in pairs), close,
                    f"prompt {int(rows['prompt'].iloc[0])} tokens, so growth is below 4x; within 25% of the "
                    f"prediction counts as holding; read from {run.label}", CH08)
