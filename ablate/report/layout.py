"""How the report's figures lay results out: which grid key is the x axis, lines per arm, series, bars.

Every figure is a function of one frame: the summary (one row per grid point x arm) joined with the
few per-run columns it lacks (KV bytes per token, the drafter, perplexity, throughput CIs). The
conventions hold across figures so that a reader can follow an arm from one to the next:

- colour = arm (in the experiment's order, tab10 then tab20); marker = the value of any further
  grid key, else the arm's own: colour and marker together tell every arm apart;
  line style = the series (p50 solid, p99 dashed; measured solid, predicted dotted);
- x = the grid key that varies (sequence length, request rate, ...), log2 when the values span
  8x or more; with no grid, or a grid of one point, the arms are bars (never a line of one x);
- error bars are 95% CIs over the rounds: a t-interval on the log scale (ablate/analysis/stats.py;
  speedup: over the per-round ratios), none under 3 rounds;
- legends sit right of the axes, never over the data; long arm names under bars are cut.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from ablate.analysis.stats import log_interval  # noqa: E402
from ablate.report.style import dodge, palette, short_labels  # noqa: E402

AXIS_LABELS = {
    "output_len": "output length (tokens)", "prompt_len": "prompt length (tokens)",
    "rate": "request rate (requests / s)", "num_requests": "requests", "prompt_kind": "prompt kind",
    "burstiness": "burstiness (gamma shape)", "seed": "workload seed",
    "seqs_admitted_max": "sequences holding KV at once (peak)",
}
# per-run columns the summary lacks that figures need: column -> how the repeats are combined
RUN_COLUMNS = {"perplexity": "median"}
# get `<column>_ci_low/high` from the rounds (log_interval) when the summary lacks them
CI_COLUMNS = ("output_throughput_tok_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
              "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "goodput_req_s",
              "goodput_ttft_req_s", "ttft_slo_attained")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
MIB = 2**20


def with_run_columns(summary: pd.DataFrame, runs: pd.DataFrame | None, point_keys: list[str]) -> pd.DataFrame:
    """The summary plus RUN_COLUMNS it lacks and CIs of CI_COLUMNS over the rounds (log_interval),
    per grid point and arm."""
    if runs is None or runs.empty:
        return summary
    keys = [*point_keys, "arm"]
    groups = runs.groupby(keys, sort=False)
    extra = pd.DataFrame(index=groups.size().index)
    for column, how in RUN_COLUMNS.items():
        if column in runs and column not in summary:
            extra[column] = groups[column].agg(how)
    for column in CI_COLUMNS:
        if column in runs and f"{column}_ci_low" not in summary and pd.api.types.is_numeric_dtype(runs[column]):
            cis = [log_interval(v.to_numpy(float)) for _, v in groups[column]]
            extra[f"{column}_ci_low"] = [ci.low for ci in cis]
            extra[f"{column}_ci_high"] = [ci.high for ci in cis]
    if extra.columns.empty:
        return summary
    return summary.merge(extra.reset_index(), on=keys, how="left")


def _has(frame: pd.DataFrame, column: str) -> bool:
    return column in frame and frame[column].notna().any()


def _varies(frame: pd.DataFrame, column: str) -> bool:
    """More than one distinct value (numbers compared to 9 decimals: a CSV round trip is not a change)."""
    if not _has(frame, column):
        return False
    values = frame[column].round(9) if pd.api.types.is_numeric_dtype(frame[column]) else frame[column]
    return values.nunique() > 1


@dataclass
class Line:
    """One arm (or drafter) at one value of the further grid keys: a line across the x axis."""
    label: str
    colour: str
    marker: str
    rows: pd.DataFrame


@dataclass
class Layout:
    """How the grid maps onto a figure: which key is the x axis, which set the markers."""
    x_key: str | None          # None: no grid key varies, arms are bars
    marker_keys: list[str]     # further varying grid keys
    arms: list[str]            # the experiment's order; arm i is colour Ci

    @classmethod
    def of(cls, frame: pd.DataFrame, point_keys: list[str]) -> Layout:
        varying = [k for k in point_keys if _varies(frame, k)]
        numeric = [k for k in varying if pd.api.types.is_numeric_dtype(frame[k])]
        x_key = (numeric or varying or [None])[0]
        return cls(x_key, [k for k in varying if k != x_key], list(dict.fromkeys(frame["arm"])))

    def colour(self, arm: str) -> str:
        return palette(self.arms.index(arm), len(self.arms))

    def marker(self, arm: str, combo: int) -> str:
        """The further grid keys' combination sets the marker; with none, the arm's own."""
        return MARKERS[(combo if self.marker_keys else self.arms.index(arm) if arm in self.arms else 0) % len(MARKERS)]

    def lines(self, frame: pd.DataFrame, by: str = "arm") -> Iterator[Line]:
        """One line per value of `by` (the arm) and combination of the marker keys, sorted along x."""
        combos = list(dict.fromkeys(map(tuple, frame[self.marker_keys].to_numpy()))) if self.marker_keys else [()]
        names = list(dict.fromkeys(frame[by]))
        for name in names:
            # colour: the arm's, the same in every figure; grouped by something else, that group's
            colour = self.colour(name) if by == "arm" else palette(names.index(name), len(names))
            for i, combo in enumerate(combos):
                rows = frame[frame[by] == name]
                for key, value in zip(self.marker_keys, combo):
                    rows = rows[rows[key] == value]
                if rows.empty:
                    continue
                if self.x_key is not None and pd.api.types.is_numeric_dtype(rows[self.x_key]):
                    rows = rows.sort_values(self.x_key)
                label = ", ".join([str(name)] + [f"{k}={v}" for k, v in zip(self.marker_keys, combo)])
                marker = self.marker(name, i) if by == "arm" else MARKERS[(i if self.marker_keys else
                                                                             names.index(name)) % len(MARKERS)]
                yield Line(label, colour, marker, rows)

    def categories(self, frame: pd.DataFrame) -> list | None:
        """The x values in order of appearance when they are not numbers (e.g. prompt_kind), else None."""
        if self.x_key is None or pd.api.types.is_numeric_dtype(frame[self.x_key]):
            return None
        return list(dict.fromkeys(frame[self.x_key]))

    def style_x(self, ax: Axes, frame: pd.DataFrame) -> None:
        """Label the x axis with the measured values as ticks; log2 when they span 8x or more."""
        ax.set_xlabel(AXIS_LABELS.get(self.x_key, self.x_key))
        categories = self.categories(frame)
        if categories is not None:
            ax.set_xticks(range(len(categories)), [str(c) for c in categories])
            ax.set_xlim(-0.5, len(categories) - 0.5)
            return
        values = np.unique(frame[self.x_key].dropna().to_numpy(float))
        if values.size > 1 and values.min() > 0 and values.max() / values.min() >= 8:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        if values.size <= 12:
            ax.set_xticks(values)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


@dataclass
class Series:
    """One quantity drawn for every line: a column, how its lines look, and its CI columns."""
    column: str
    label: str
    linestyle: str = "-"
    ci: tuple[str, str] | None = None
    hollow: bool = False


def _y(rows: pd.DataFrame, column: str) -> np.ndarray:
    values = rows[column].to_numpy(float)
    return values / MIB if column.endswith("bytes") else values


def _yerr(rows: pd.DataFrame, series: Series) -> np.ndarray | None:
    if series.ci is None or series.ci[0] not in rows:
        return None
    y = _y(rows, series.column)
    low, high = _y(rows, series.ci[0]), _y(rows, series.ci[1])
    return np.nan_to_num(np.vstack([y - low, high - y]).clip(min=0))


def plot_series(ax: Axes, frame: pd.DataFrame, layout: Layout, series: list[Series],
                by: str = "arm") -> list[Line2D]:
    """Every series for every line: lines along x, or grouped bars with no grid; returns legend handles."""
    series = [s for s in series if _has(frame, s.column)]
    handles: list[Line2D] = []
    lines = list(layout.lines(frame, by))
    categories = layout.categories(frame)
    for i, line in enumerate(lines):
        if layout.x_key is not None:        # bars carry their arm's name on the x axis instead
            handles.append(Line2D([], [], color=line.colour, marker=line.marker, label=line.label))
        for j, s in enumerate(series):
            y = _y(line.rows, s.column)
            face = "white" if s.hollow else line.colour
            if layout.x_key is None:            # bars: one group per line, one bar per series
                width = 0.8 / len(series)
                ax.bar(i - 0.4 + width * (j + 0.5), y, width, yerr=_yerr(line.rows, s), capsize=3,
                       color=line.colour, alpha=1.0 if j == 0 else 0.55, hatch=None if j == 0 else "//",
                       edgecolor="black", linewidth=0.5)
                continue
            linestyle = s.linestyle
            if categories is None:    # each line a little aside too, so that error bars at one x stay apart
                x = dodge(line.rows[layout.x_key].to_numpy(float), frame[layout.x_key], i, len(lines))
            else:   # unordered values: no lines between them, each line a little aside so CIs stay apart
                x = np.array([categories.index(v) for v in line.rows[layout.x_key]]) + 0.3 * (
                    (i + 0.5) / len(lines) - 0.5)
                linestyle = "none"
            ax.errorbar(x, y, yerr=_yerr(line.rows, s), color=line.colour, marker=line.marker, linestyle=linestyle,
                        markerfacecolor=face, capsize=3, linewidth=1.4)
    if layout.x_key is None:
        ax.set_xticks(range(len(lines)), short_labels([line.label for line in lines]), rotation=25, ha="right",
                      fontsize=8)
    else:
        layout.style_x(ax, frame)
    if len(series) > 1:                    # what the line styles (or bar shades) mean
        for j, s in enumerate(series):
            if layout.x_key is None:
                handles.append(Patch(facecolor="grey", alpha=1.0 if j == 0 else 0.55, hatch=None if j == 0 else "//",
                                     label=s.label))
            else:
                handles.append(Line2D([], [], color="grey", linestyle=s.linestyle, marker="o",
                                      markerfacecolor="white" if s.hollow else "grey", label=s.label))
    ax.grid(alpha=0.3)
    return handles


def _figure(num_panels: int = 1) -> tuple[Figure, list[Axes]]:
    fig, axes = plt.subplots(1, num_panels, figsize=(5.0 * num_panels + 2.6, 4.2), squeeze=False,
                             layout="constrained")     # room for the legend outside the axes
    return fig, list(axes[0])


def _legend(fig: Figure, handles: list) -> None:
    """Right of the axes, never over the data (the constrained layout makes room); one entry per label."""
    handles = list({h.get_label(): h for h in handles}.values())
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)


def _from_zero(ax: Axes) -> None:
    """A y axis from 0 with room above the highest point (the default margin is a share of the data's
    range, which is nothing when all values are close)."""
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)


def _log_if_wide(ax: Axes, frame: pd.DataFrame, columns: list[str]) -> None:
    values = np.concatenate([_y(frame, c) for c in columns if c in frame])
    values = values[np.isfinite(values) & (values > 0)]
    if values.size and values.max() / values.min() > 30:
        ax.set_yscale("log")


def _baseline_arms(frame: pd.DataFrame) -> list[str]:
    """Arms whose speedup is 1 with a CI of [1, 1] at every point: the baseline, by definition."""
    ones = frame[["speedup", "speedup_ci_low", "speedup_ci_high"]].eq(1.0).all(axis=1)
    return [arm for arm, is_one in ones.groupby(frame["arm"], sort=False).all().items() if is_one]
