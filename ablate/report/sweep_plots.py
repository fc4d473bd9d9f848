"""The sweep report (sweep_report.md): which keys were swept, and per swept key a table and a figure.

Every figure is one swept key on the x axis (log2 when its values span 8x or more) with one line per
arm, each arm its own colour and marker, and a line style per combination of the other swept keys;
its panels are speedup, output throughput and TTFT p99, each point with its 95% CI as error bars:
speedup's from summary.csv (the per-round ratios' t-interval), the others' from the rounds in
runs.csv (geometric mean and t-interval of the logs, ablate.analysis.stats.log_interval). A key
with a single measured value gets no figure. The legend sits below the panels, never over the data.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from ablate.analysis.stats import Interval, log_interval  # noqa: E402
from ablate.results import write_atomic, write_file_atomic  # noqa: E402

if TYPE_CHECKING:
    from ablate.report.collect import Sweep

# (column, panel's y label, unit in the tables, digits)
METRICS = (("speedup_x", "speedup over the baseline (x)", "x", 2),
           ("output_throughput_tok_s", "output throughput (tokens / s)", " tok/s", 1),
           ("ttft_p99_ms", "TTFT p99 (ms)", " ms", 2))
ROUND_METRICS = ("output_throughput_tok_s", "ttft_p99_ms")     # CIs over the rounds of runs.csv
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", ":", "-.")


def _short(key: str) -> str:
    return key.removeprefix("config.")


def _numeric(values: pd.Series) -> pd.Series | None:
    """The values as numbers, or None when any is not one (then the key is categorical)."""
    numbers = pd.to_numeric(values, errors="coerce")
    return numbers if numbers.notna().sum() == values.notna().sum() and values.notna().any() else None


def points(sweep: Sweep) -> pd.DataFrame:
    """One row per job x grid point x arm that was measured: the swept keys' values, and for each of
    METRICS its centre, `_low`, `_high` and `_note` (why no interval)."""
    keys = list(dict.fromkeys(["job", *sweep.grid_keys, "arm"]))
    runs = sweep.runs[sweep.runs["status"] != "failed"]
    if "arm" not in runs or runs["arm"].isna().all():
        return pd.DataFrame()
    runs = runs[runs["arm"].notna()]
    if "arm_status" in runs:
        runs = runs[runs["arm_status"].fillna("ok") == "ok"]
    rows = []
    for key, frame in runs.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key)) | {k: frame[k].iloc[0] for k in sweep.swept if k in frame}
        for metric in ROUND_METRICS:
            it = log_interval(frame[metric]) if metric in frame else Interval(np.nan, np.nan, np.nan, 0,
                                                                               "not measured")
            row |= {metric: it.center, f"{metric}_low": it.low, f"{metric}_high": it.high,
                    f"{metric}_note": it.note}
        rows.append(row)
    table = pd.DataFrame(rows)
    if "speedup_x" in sweep.summary:
        names = {"speedup_x": "speedup_x", "speedup_ci_low_x": "speedup_x_low", "speedup_ci_high_x": "speedup_x_high",
                 "speedup_note": "speedup_x_note"}
        columns = [c for c in names if c in sweep.summary]
        speedups = sweep.summary.loc[sweep.summary["arm"].notna(), [*keys, *columns]].rename(columns=names)
        table = table.merge(speedups, on=keys, how="left")
    return table


def _interval(row: pd.Series, metric: str) -> Interval:
    center = row.get(metric, np.nan)
    note = row.get(f"{metric}_note") if isinstance(row.get(f"{metric}_note"), str) else ""
    return Interval(float(center), float(row.get(f"{metric}_low", np.nan)), float(row.get(f"{metric}_high", np.nan)),
                    0, note or "no interval")


def _others(table: pd.DataFrame, swept: list[str], key: str) -> list[str]:
    """The other swept keys that vary among the measured points: a line per combination of them."""
    return [k for k in swept if k != key and k in table and table[k].astype(str).nunique() > 1]


def key_table(table: pd.DataFrame, swept: list[str], key: str) -> pd.DataFrame:
    """Value of `key` -> per arm (and combination of the other swept keys): the METRICS with CIs."""
    others = _others(table, swept, key)
    numeric = _numeric(table[key])
    order = table.assign(_x=numeric if numeric is not None else table[key].astype(str))
    order = order.sort_values(["_x", *others], kind="stable")
    shown = order[[key, *others, "arm"]].rename(columns={k: _short(k) for k in [key, *others]})
    for metric, label, unit, digits in METRICS:
        shown[f"{label.split(' (')[0]} [95% CI]"] = [_interval(row, metric).text(unit, digits)
                                                      for _, row in order.iterrows()]
    return shown


def _yerr(rows: pd.DataFrame, metric: str) -> np.ndarray:
    y = rows[metric].to_numpy(float)
    low = rows.get(f"{metric}_low", pd.Series(np.nan, index=rows.index)).to_numpy(float)
    high = rows.get(f"{metric}_high", pd.Series(np.nan, index=rows.index)).to_numpy(float)
    return np.nan_to_num(np.vstack([y - low, high - y]).clip(min=0))


def _dodge(line: int, lines: int) -> float:
    """Line `line` of `lines` at one x value: its shift, a fraction of the x range, so CIs stay apart."""
    return (line - (lines - 1) / 2) * min(0.012, 0.06 / max(lines, 1))


def key_figure(table: pd.DataFrame, swept: list[str], key: str) -> Figure | None:
    """`key` on x, a line per arm (x other swept keys), a panel per metric; None with one value of `key`."""
    measured = table[table[key].notna()]
    if measured[key].astype(str).nunique() < 2:
        return None
    metrics = [m for m in METRICS if m[0] in measured and measured[m[0]].notna().any()]
    if not metrics:
        return None
    numeric = _numeric(measured[key])
    categories = None if numeric is not None else list(dict.fromkeys(measured[key].astype(str)))
    x_all = numeric if numeric is not None else measured[key].astype(str).map(categories.index)
    measured = measured.assign(_x=x_all.to_numpy(float))
    others = _others(measured, swept, key)
    combos = list(dict.fromkeys(map(tuple, measured[others].astype(str).to_numpy()))) if others else [()]
    arms = list(dict.fromkeys(measured["arm"]))
    values = np.unique(measured["_x"].to_numpy(float))
    log2 = categories is None and values.min() > 0 and values.max() / values.min() >= 8
    width = 5.0 if categories is not None else float(np.ptp(values))     # of the x range, in x units
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 4.0), squeeze=False, layout="constrained")
    for ax, (metric, label, _, _) in zip(axes[0], metrics):
        for a, arm in enumerate(arms):
            for c, combo in enumerate(combos):
                rows = measured[measured["arm"] == arm]
                for k, v in zip(others, combo):
                    rows = rows[rows[k].astype(str) == v]
                rows = rows[rows[metric].notna()].sort_values("_x")
                if rows.empty:
                    continue
                shift = _dodge(a * len(combos) + c, len(arms) * len(combos))   # error bars side by side
                x = rows["_x"].to_numpy(float)
                x = x * 2 ** (shift * np.log2(values.max() / values.min())) if log2 else x + shift * width
                ax.errorbar(x, rows[metric], yerr=_yerr(rows, metric), color=f"C{a % 10}",
                            marker=MARKERS[a % len(MARKERS)], linestyle=LINESTYLES[c % len(LINESTYLES)],
                            capsize=3, linewidth=1.4)
        if metric == "speedup_x":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label)
        ax.set_xlabel(_short(key))
        ax.grid(alpha=0.3)
        if categories is not None:
            ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
        else:
            if log2:
                ax.set_xscale("log", base=2)
            if values.size <= 12:
                ax.set_xticks(values, [f"{v:g}" for v in values])
                ax.minorticks_off()
    handles = [Line2D([], [], color=f"C{a % 10}", marker=MARKERS[a % len(MARKERS)], label=str(arm))
               for a, arm in enumerate(arms)]
    if others:
        handles += [Line2D([], [], color="grey", linestyle=LINESTYLES[c % len(LINESTYLES)],
                           label=", ".join(f"{_short(k)}={v}" for k, v in zip(others, combo)))
                    for c, combo in enumerate(combos)]
    fig.suptitle(f"{_short(key)}: each point a geometric mean over rounds with its 95% CI", fontsize=10)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    return fig


def figure_name(key: str) -> str:
    return "sweep_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", _short(key)) + ".png"


def _save(fig: Figure, path: Path) -> None:
    try:
        write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)


def _values(sweep: Sweep, key: str) -> str:
    values = sweep.summary[key].dropna() if key in sweep.summary else pd.Series(dtype=object)
    numbers = _numeric(values)
    unique = sorted(set(numbers)) if numbers is not None else list(dict.fromkeys(values.astype(str)))
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in unique)


def _markdown(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False, floatfmt=".4g")


def write_sweep_report(sweep: Sweep, out: Path) -> tuple[Path, dict[str, Path]]:
    """sweep_report.md and its figures in `out`; returns the report's path and swept key -> figure path."""
    counts = sweep.counts()
    lines = [f"# Sweep: {sweep.root}", "",
             f"{len(sweep.jobs)} jobs: {counts['done']} done, {counts['failed']} failed, {counts['running']} running "
             f"(experiments: {', '.join(dict.fromkeys(sweep.jobs['experiment']))}). Tables: sweep_runs.csv (job x "
             "grid point x arm x round), sweep_summary.csv (job x grid point x arm), and .parquet beside each.", "",
             "## Swept keys", ""]
    lines += [f"- `{_short(k)}`{' (grid)' if k in sweep.grid_keys else ''}: {_values(sweep, k)}" for k in sweep.swept]
    lines += ["- nothing: the jobs share one config"] if not sweep.swept else []
    config_swept = [k for k in sweep.swept if k not in sweep.grid_keys]
    jobs = sweep.summary.drop_duplicates("job")[["job", "experiment", "status", *config_swept, "error"]]
    lines += ["", "## Jobs", "", _markdown(jobs.rename(columns={k: _short(k) for k in config_swept}).fillna("")), ""]
    if sweep.problems:
        lines += ["## Left out", "", *[f"- {p}" for p in sweep.problems], ""]
    table = points(sweep)
    figures: dict[str, Path] = {}
    for key in sweep.swept:
        lines += [f"## `{_short(key)}`", ""]
        if table.empty or key not in table or table[key].isna().all():
            lines += ["No measured point (every job failed or is still running).", ""]
            continue
        lines += [_markdown(key_table(table, sweep.swept, key)), ""]
        fig = key_figure(table, sweep.swept, key)
        if fig is None:
            lines += [f"One measured value of `{_short(key)}`: no figure.", ""]
            continue
        figures[key] = out / figure_name(key)
        _save(fig, figures[key])
        lines += [f"![{_short(key)}]({figures[key].name})", ""]
    lines += ["CIs: 95%. Speedup: per-round ratio baseline time / arm time, from summary.csv. Throughput and TTFT "
              "p99: geometric mean and log t-interval over the rounds (n/a below 3 rounds).", ""]
    report = out / "sweep_report.md"
    write_atomic(report, "\n".join(lines))
    return report, figures
