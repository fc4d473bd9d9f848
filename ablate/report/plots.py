"""The report's figures, each drawn only when the results hold what it needs.

Every figure is a function of one frame: the summary (one row per grid point x arm) joined with the
few per-run columns it lacks (perplexity, throughput CIs); its conventions are in layout.py. The
core's figures are below; a plugin adds its own by declaring StatFigures (ablate.api), drawn by
`plugin_figure`, and a stat that predicts a measured column adds a dotted series to that column's
figure (kv_util_mean: the paging model's prediction).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from ablate.api.plugin import StatFigure  # noqa: E402
from ablate.report.declared import Declarations  # noqa: E402
from ablate.report.layout import (  # noqa: E402
    AXIS_LABELS,
    Layout,
    Series,
    _baseline_arms,
    _figure,
    _from_zero,
    _has,
    _legend,
    _log_if_wide,
    _varies,
    plot_series,
    with_run_columns,
)

__all__ = ["caption", "draw", "with_run_columns"]


# -- the figures: each returns None when the results do not hold what it needs ------------------------------

def speedup_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not _has(frame, "speedup"):
        return None
    baselines = _baseline_arms(frame)
    arms = frame[~frame["arm"].isin(baselines)]
    if arms.empty:
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, arms, layout, [
        Series("speedup", "measured (median, 95% CI)", "-", ("speedup_ci_low", "speedup_ci_high")),
        Series("predicted_speedup", "predicted (roofline)", ":", hollow=True)])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    handles.append(Line2D([], [], color="black", linewidth=0.8, linestyle="--",
                          label=f"baseline: {', '.join(baselines) or 'none'}"))
    ax.set_ylabel("speedup over the baseline (x)")
    ax.set_title("Speedup: baseline time / arm time per round")
    _legend(fig, handles)
    return fig


def throughput_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not _has(frame, "output_throughput_tok_s"):
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, frame, layout, [Series(
        "output_throughput_tok_s", "median, 95% CI", ci=("output_throughput_tok_s_ci_low",
                                                         "output_throughput_tok_s_ci_high"))])
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput (median over repeats, 95% CI)")
    _legend(fig, handles)
    return fig


def latency_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    panels = [(name, [Series(f"{key}_p50_ms", "p50", "-"), Series(f"{key}_p99_ms", "p99", "--", hollow=True)])
              for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")) if _has(frame, f"{key}_p50_ms")]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    handles = []
    for ax, (name, series) in zip(axes, panels):
        handles += plot_series(ax, frame, layout, series)
        _log_if_wide(ax, frame, [s.column for s in series])
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 and p99 (median over repeats)")
    _legend(fig, handles)
    return fig


def memory_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not _has(frame, "peak_memory_bytes"):
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, frame, layout, [Series("peak_memory_bytes", "peak memory", "-"),
                                              Series("kv_reserved_peak_bytes", "KV reserved (peak)", "--",
                                                     hollow=True)])
    ax.set_ylabel("MiB")
    _from_zero(ax)
    ax.set_title("Peak memory and KV cache reserved")
    _legend(fig, handles)
    return fig


def memory_vs_concurrency_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    """KV bytes against the sequences held at once: the memory price of concurrency, and (when the
    arms' KV bytes per token differ, e.g. GQA/MQA/MLA) how many sequences each byte budget buys."""
    if not (_has(frame, "seqs_admitted_max") and _has(frame, "kv_reserved_peak_bytes")):
        return None
    per_token = _varies(frame, "kv_bytes_per_token")
    if not (_varies(frame, "seqs_admitted_max") or per_token):
        return None
    fig, axes = _figure(2 if per_token else 1)
    # one line per arm through its grid points, in order of concurrency: the memory each sequence costs
    by_seqs = Layout("seqs_admitted_max", [], layout.arms)
    handles = plot_series(axes[0], frame, by_seqs, [Series("kv_reserved_peak_bytes", "KV reserved (peak)", "-"),
                                                    Series("kv_used_peak_bytes", "KV used (peak)", "--", hollow=True)])
    axes[0].set_ylabel("KV MiB")
    _from_zero(axes[0])
    axes[0].set_title("KV memory vs concurrency")
    if per_token:
        ax = axes[1]
        for line in by_seqs.lines(frame):
            ax.scatter(line.rows["kv_bytes_per_token"] / 1024, line.rows["seqs_admitted_max"], color=line.colour,
                       marker=line.marker, s=40)
            for row in line.rows.itertuples():
                ax.annotate(line.label, (row.kv_bytes_per_token / 1024, row.seqs_admitted_max), fontsize=7,
                            xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("KV KiB per token")
        ax.set_ylabel("sequences holding KV at once (peak)")
        ax.set_title("Sequences admitted vs KV bytes per token")
        ax.grid(alpha=0.3)
    _legend(fig, handles)
    return fig


def kv_utilisation_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not _has(frame, "kv_util_mean"):
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, frame, layout, [Series("kv_util_mean", "measured", "-"),
                                              *predicted_series(declared, "kv_util_mean")])
    ax.set_ylabel("KV used / reserved (time-weighted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("KV cache utilisation")
    _legend(fig, handles)
    return fig


def goodput_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not _has(frame, "goodput_req_s"):
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, frame, layout, [Series("goodput_req_s", "goodput")])
    ax.set_ylabel("requests / s meeting every SLO")
    ax.set_title("Goodput")
    _legend(fig, handles)
    return fig


def kv_vs_perplexity_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not (_has(frame, "perplexity") and _has(frame, "kv_bytes_per_token")):
        return None
    fig, (ax,) = _figure()
    by_arm = Layout(None, [k for k in [layout.x_key, *layout.marker_keys] if k], layout.arms)
    for line in by_arm.lines(frame):
        ax.scatter(line.rows["kv_bytes_per_token"] / 1024, line.rows["perplexity"], color=line.colour,
                   marker=line.marker, s=40)
        for row in line.rows.itertuples():
            ax.annotate(line.label, (row.kv_bytes_per_token / 1024, row.perplexity), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xlabel("KV KiB per token")
    ax.set_ylabel("perplexity (held-out text)")
    ax.set_title("KV bytes per token vs perplexity")
    ax.grid(alpha=0.3)
    return fig


def predicted_series(declared: Declarations, column: str) -> list[Series]:
    """A dotted series for each plugin stat that predicts `column`."""
    return [Series(name, f"predicted ({stat.description})", ":", hollow=True)
            for name, stat in declared.stats.items() if stat.predicts == column]


def plugin_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations, slot: str,
                  spec: StatFigure) -> Figure | None:
    """A figure a plugin declares: its series against its x, one line per value of its group_by
    (or per arm), the grid's own keys as markers."""
    x = declared.column(slot, spec.x)
    series = [declared.column(slot, name) for name in spec.series]
    if not (_varies(frame, x) and any(_has(frame, c) for c in series)):
        return None                 # drawn against its x: only when the arms span several values of it
    rows = frame[frame[x].notna()].copy()
    by = declared.column(slot, spec.group_by) if spec.group_by else "arm"
    if by not in rows:
        rows[by] = slot
    layout = Layout(x, [k for k in [layout.x_key, *layout.marker_keys] if k], layout.arms)
    fig, (ax,) = _figure()
    styles = ["-", "--", ":", "-."]
    handles = plot_series(ax, rows, layout, [
        Series(c, declared.stats[c].description if c in declared.stats else c, styles[i % 4],
               ("speedup_ci_low", "speedup_ci_high") if c == "speedup" else None, hollow=i > 0)
        for i, c in enumerate(series)], by=by)
    if "speedup" in series:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(declared.stats[x].description if x in declared.stats else AXIS_LABELS.get(x, x))
    ax.set_ylabel(spec.ylabel)
    ax.set_title(spec.title)
    _legend(fig, handles)
    return fig


FIGURES: dict[str, tuple[Callable[[pd.DataFrame, Layout, Declarations], Figure | None], str]] = {
    # name: (figure, the caption the report prints under it)
    "speedup": (speedup_figure, "Speedup of each arm over the baseline: the median of the per-round ratios "
                                "with its bootstrap 95% CI; dotted: the analytic roofline's prediction."),
    "throughput": (throughput_figure, "Output tokens per second, median over repeats with a bootstrap 95% CI."),
    "latency": (latency_figure, "Time to first token and time per output token: p50 (solid) and p99 (dashed) "
                                "over requests, the median of each over repeats."),
    "memory": (memory_figure, "Peak memory (device allocator, or tracked tensors on the CPU) and the KV cache's "
                              "peak reservation."),
    "memory_vs_concurrency": (memory_vs_concurrency_figure,
                              "KV memory reserved and used against the sequences holding KV at once; with arms "
                              "of different KV bytes per token, the sequences each admits."),
    "kv_utilisation": (kv_utilisation_figure, "KV utilisation (used / reserved, time-weighted), measured and, "
                                              "where the cache reports one, predicted (dotted)."),
    "goodput": (goodput_figure, "Requests per second that met every SLO set."),
    "kv_vs_perplexity": (kv_vs_perplexity_figure, "KV bytes per token against held-out perplexity, per arm."),
}


def draw(summary: pd.DataFrame, point_keys: list[str], out_dir: Path, runs: pd.DataFrame | None = None,
         declared: Declarations | None = None) -> dict[str, Path]:
    """Write one PNG per figure the results can fill (the core's, then the plugins'); returns name -> path."""
    if summary.empty:
        return {}
    declared = declared or Declarations()
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = with_run_columns(summary, runs, point_keys)
    layout = Layout.of(frame, point_keys)
    made = [(name, lambda make=make: make(frame, layout, declared)) for name, (make, _) in FIGURES.items()]
    made += [(spec.name, lambda slot=slot, spec=spec: plugin_figure(frame, layout, declared, slot, spec))
             for slot, spec in declared.figures]
    written = {}
    for name, make in made:
        fig = make()
        if fig is None:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written[name] = path
    return written


def caption(name: str, declared: Declarations | None = None) -> str:
    if name in FIGURES:
        return FIGURES[name][1]
    return next((spec.caption for _, spec in (declared or Declarations()).figures if spec.name == name), "")
