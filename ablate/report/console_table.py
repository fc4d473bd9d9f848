"""The summary as a job prints it: the few columns that matter, in at most CONSOLE_WIDTH columns, and
the summary's notes beneath (report.md has the full table)."""
from __future__ import annotations

import pandas as pd

from ablate.report.tables import _column, _fmt, _missing, speedup_text, summary_notes


CONSOLE_WIDTH = 100
MIN_ARM_WIDTH = 12
ARM_COMFORT = 20      # arm names are cut to this before any column is dropped
CONSOLE_FOOTER = "speedup: baseline time / arm time per round, geometric mean [95% CI]; TTFT99, TPOT99: p99 ms"
QUALITY_FOOTER = "ppl: perplexity / the baseline's; agree: share of tokens that match the baseline's"


def _readable_bytes(n: float) -> str:
    """'512 MiB', '1.25 GiB', '12 KiB': a byte count to three figures or so."""
    if _missing(n) or pd.isna(n):
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if abs(n) < 10 * size else f"{n / size:,.0f} {unit}"
    return f"{n:,.0f} B"


def _short_number(x: float) -> str:
    if _missing(x) or pd.isna(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _shorten(text: str, width: int) -> str:
    """Cut from the middle, where long arm names repeat themselves: 'kv_cache=pag..attention=flash'."""
    if len(text) <= width:
        return text
    tail = (width - 2) // 2
    return text[:width - 2 - tail] + ".." + text[-tail:]


def _arm_names(arms: list[str], width: int) -> list[str]:
    """Each arm's name within `width`, distinct arms kept distinct (a number where cuts collide)."""
    short = [_shorten(a, width) for a in arms]
    distinct = dict.fromkeys(arms)
    if len(set(short)) < len(distinct):
        index = {a: i for i, a in enumerate(distinct)}
        short = [s if s == a else _shorten(a, width - 3)[:width - 3] + f"~{index[a]:02d}"
                 for s, a in zip(short, arms)]
    return short


def console_table(summary: pd.DataFrame, point_keys: list[str], width: int = CONSOLE_WIDTH) -> str:
    """The summary as a job prints it: point, arm, status (when an arm is not ok), speedup [95% CI],
    tok/s, TTFT and TPOT p99, peak memory and (when measured) ppl ratio and token agreement, every
    line within `width` characters; report.md has the full table. Long arm names are cut in the
    middle (to ARM_COMFORT, then the least needed columns go, then to MIN_ARM_WIDTH); footer lines
    name the units, then the summary's notes (each arm not ok and why, contended rounds left out,
    unstable times) and each quality flag raised."""
    if summary.empty:
        return "(no results)"
    arms = [str(a) for a in summary["arm"]]
    status = [str(s) for s in _column(summary, "status").astype(object).fillna("ok")]
    columns: list[tuple[str, list[str], bool]] = [   # header, cells, right-aligned
        *[(k.split(".")[-1][:12], [str(v) for v in summary[k]], False) for k in point_keys if k in summary],
        ("arm", arms, False),
        *([("status", status, False)] if any(s != "ok" for s in status) else []),
        ("speedup [95% CI]", [speedup_text(r, short=True) for _, r in summary.iterrows()], True),
        ("tok/s", _column(summary, "output_throughput_tok_s").map(_short_number).tolist(), True),
        ("TTFT99", _column(summary, "ttft_p99_ms").map(_short_number).tolist(), True),
        ("TPOT99", _column(summary, "tpot_p99_ms").map(_short_number).tolist(), True),
        ("peak mem", _column(summary, "peak_memory_bytes").map(_readable_bytes).tolist(), True)]
    if _column(summary, "ppl_ratio").notna().any():
        columns.append(("ppl", summary["ppl_ratio"].map(_fmt(".3f")).tolist(), True))
    if _column(summary, "token_agreement").notna().any():
        columns.append(("agree", summary["token_agreement"].map(_fmt(".0%")).tolist(), True))
    widths = {h: max(len(h), *map(len, cells)) for h, cells, _ in columns}

    def excess() -> int:
        return sum(widths.values()) + 2 * (len(widths) - 1) - width

    for drop in ("tok/s", "agree", None):     # arm names give way to ARM_COMFORT, then these columns go
        widths["arm"] = max(min(widths["arm"], ARM_COMFORT), widths["arm"] - max(excess(), 0))
        if excess() <= 0 or drop is None:
            break
        widths.pop(drop, None)
    widths["arm"] = max(MIN_ARM_WIDTH, widths["arm"] - max(excess(), 0))
    columns = [(h, _arm_names(arms, widths[h]) if h == "arm" else cells, right)
               for h, cells, right in columns if h in widths]
    rows = [[h for h, _, _ in columns]] + [list(r) for r in zip(*(cells for _, cells, _ in columns))]
    lines = ["  ".join(c.rjust(widths[h]) if right else c.ljust(widths[h]) for c, (h, _, right) in zip(row, columns))
             .rstrip() for row in rows]
    lines.append(CONSOLE_FOOTER)
    if "ppl" in widths or "agree" in widths:
        lines.append(QUALITY_FOOTER)
    shown = dict(zip(arms, next(cells for h, cells, _ in columns if h == "arm")))
    lines += [f"{short} = {arm}" for arm, short in shown.items() if short != arm and "~" in short]
    lines += summary_notes(summary, [])     # once for all grid points where a note repeats (below)
    flags = _column(summary, "quality_flag")
    lines += [f"{arm}: quality flag: {f}" for arm, f in zip(arms, flags) if isinstance(f, str) and f not in ("", "ok")]
    lines = list(dict.fromkeys(lines))     # the same note at every grid point: once
    return "\n".join(line if len(line) <= width else line[:width - 3] + "..." for line in lines)
