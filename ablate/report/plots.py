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
from ablate.results import write_file_atomic  # noqa: E402
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
        Series("speedup", "measured (geometric mean, 95% CI)", "-", ("speedup_ci_low", "speedup_ci_high")),
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
        "output_throughput_tok_s", "median, 95% CI", ci=_ci("output_throughput_tok_s"))])
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput (median over rounds, 95% CI)")
    _legend(fig, handles)
    return fig


def _ci(column: str) -> tuple[str, str]:
    return f"{column}_ci_low", f"{column}_ci_high"


def _slo_line(ax, slo_ms: float | None, what: str) -> list[Line2D]:
    """The SLO as a horizontal line, and its legend entry; nothing when none is set."""
    if slo_ms is None:
        return []
    ax.axhline(slo_ms, color="firebrick", linewidth=1.0, linestyle="-.")
    return [Line2D([], [], color="firebrick", linewidth=1.0, linestyle="-.", label=f"{what} SLO {slo_ms:g} ms")]


def latency_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None,
                   slo: dict[str, float | None] | None = None) -> Figure | None:
    """TTFT and TPOT p50 and p99 with their CIs over rounds; an SLO set (slo: ttft/tpot -> ms) is a line."""
    panels = [(name, key, [Series(f"{key}_p50_ms", "p50", "-", _ci(f"{key}_p50_ms")),
                           Series(f"{key}_p99_ms", "p99", "--", _ci(f"{key}_p99_ms"), hollow=True)])
              for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")) if _has(frame, f"{key}_p50_ms")]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    handles = []
    for ax, (name, key, series) in zip(axes, panels):
        handles += plot_series(ax, frame, layout, series) + _slo_line(ax, (slo or {}).get(key), name)
        _log_if_wide(ax, frame, [s.column for s in series])
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 and p99 (median over rounds, 95% CI)")
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


def _scatter(ax, frame: pd.DataFrame, layout: Layout, x: str, y: str, x_scale: float = 1.0) -> list[Line2D]:
    """One point per row, colour and marker by arm (and further grid keys), named in the legend
    rather than by labels beside the points (those collide where points lie close)."""
    by_arm = Layout(None, [k for k in [layout.x_key, *layout.marker_keys] if k], layout.arms)
    handles = []
    for line in by_arm.lines(frame):
        ax.scatter(line.rows[x] / x_scale, line.rows[y], color=line.colour, marker=line.marker, s=40)
        handles.append(Line2D([], [], color=line.colour, marker=line.marker, linestyle="none", label=line.label))
    ax.grid(alpha=0.3)
    return handles


def memory_vs_concurrency_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    """KV bytes against the sequences held at once: the memory price of concurrency, and (when the
    arms' KV bytes per token differ, e.g. GQA/MQA/MLA) how many sequences each byte budget buys."""
    if not (_has(frame, "seqs_admitted_max") and _has(frame, "kv_reserved_peak_bytes")):
        return None
    per_token = _varies(frame, "kv_bytes_per_token")
    by_seqs = _varies(frame, "seqs_admitted_max")      # else a line of one x value: no panel
    if not (by_seqs or per_token):
        return None
    fig, axes = _figure(by_seqs + per_token)
    handles = []
    if by_seqs:   # one line per arm through its grid points, in order of concurrency: the memory a sequence costs
        handles += plot_series(axes[0], frame, Layout("seqs_admitted_max", [], layout.arms), [
            Series("kv_reserved_peak_bytes", "KV reserved (peak)", "-"),
            Series("kv_used_peak_bytes", "KV used (peak)", "--", hollow=True)])
        axes[0].set_ylabel("KV MiB")
        _from_zero(axes[0])
        axes[0].set_title("KV memory vs concurrency")
    if per_token:
        ax = axes[-1]
        handles += _scatter(ax, frame, layout, "kv_bytes_per_token", "seqs_admitted_max", 1024)
        ax.set_xlabel("KV KiB per token")
        ax.set_ylabel("sequences holding KV at once (peak)")
        ax.set_title("Sequences admitted vs KV bytes per token")
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


def goodput_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None,
                   slo: dict[str, float | None] | None = None) -> Figure | None:
    if not _has(frame, "goodput_req_s"):
        return None
    fig, (ax,) = _figure()
    handles = plot_series(ax, frame, layout, [   # the TTFT SLO alone (dashed) where one is set
        Series("goodput_req_s", "every SLO set", ci=_ci("goodput_req_s")),
        Series("goodput_ttft_req_s", "TTFT SLO alone", "--", _ci("goodput_ttft_req_s"), hollow=True)])
    ax.set_ylabel("requests / s meeting the SLOs")
    _from_zero(ax)
    slos = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in (slo or {}).items() if v is not None)
    ax.set_title(f"Goodput ({slos})" if slos else "Goodput")
    _legend(fig, handles)
    return fig


def kv_vs_perplexity_figure(frame: pd.DataFrame, layout: Layout, declared: Declarations | None = None) -> Figure | None:
    if not (_has(frame, "perplexity") and _has(frame, "kv_bytes_per_token")):
        return None
    fig, (ax,) = _figure()
    handles = _scatter(ax, frame, layout, "kv_bytes_per_token", "perplexity", 1024)
    ax.set_xlabel("KV KiB per token")
    ax.set_ylabel("perplexity (held-out text)")
    ax.set_title("KV bytes per token vs perplexity")
    _legend(fig, handles)
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


SLO_FIGURES = ("latency", "goodput")     # these take the SLOs set: slo={"ttft": ms, "tpot": ms}
FIGURES: dict[str, tuple[Callable[[pd.DataFrame, Layout, Declarations], Figure | None], str]] = {
    # name: (figure, the caption the report prints under it)
    "speedup": (speedup_figure, "Speedup of each arm over the baseline: the geometric mean of the per-round "
                                "ratios with its 95% CI (t on the log scale); dotted: the analytic roofline's "
                                "prediction."),
    "throughput": (throughput_figure, "Output tokens per second, median over rounds; bars: 95% CI over rounds "
                                      "(t on the log scale)."),
    "latency": (latency_figure, "Time to first token and time per output token: p50 (solid) and p99 (dashed) "
                                "over requests, the median of each over rounds with a 95% CI over rounds; "
                                "dash-dotted: the SLO, where one is set."),
    "memory": (memory_figure, "Peak memory (device allocator, or tracked tensors on the CPU) and the KV cache's "
                              "peak reservation."),
    "memory_vs_concurrency": (memory_vs_concurrency_figure,
                              "KV memory reserved and used against the sequences holding KV at once; with arms "
                              "of different KV bytes per token, the sequences each admits."),
    "kv_utilisation": (kv_utilisation_figure, "KV utilisation (used / reserved, time-weighted), measured and, "
                                              "where the cache reports one, predicted (dotted)."),
    "goodput": (goodput_figure, "Requests per second that met every SLO set (dashed: the TTFT SLO alone, where "
                                "one is set), median over rounds with a 95% CI."),
    "kv_vs_perplexity": (kv_vs_perplexity_figure, "KV bytes per token against held-out perplexity, per arm."),
}


def draw(summary: pd.DataFrame, point_keys: list[str], out_dir: Path, runs: pd.DataFrame | None = None,
         declared: Declarations | None = None, ttft_slo_ms: float | None = None,
         tpot_slo_ms: float | None = None) -> dict[str, Path]:
    """Write one PNG per figure the results can fill (the core's, then the plugins'); returns name -> path.
    SLOs set are drawn as lines on the latency figure and named on the goodput figure."""
    if summary.empty:
        return {}
    declared = declared or Declarations()
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = with_run_columns(summary, runs, point_keys)
    layout = Layout.of(frame, point_keys)
    slo = {"ttft": ttft_slo_ms, "tpot": tpot_slo_ms}
    options = {name: {"slo": slo} for name in SLO_FIGURES}
    made = [(name, lambda make=make, name=name: make(frame, layout, declared, **options.get(name, {})))
            for name, (make, _) in FIGURES.items()]
    made += [(spec.name, lambda slot=slot, spec=spec: plugin_figure(frame, layout, declared, slot, spec))
             for slot, spec in declared.figures]
    written = {}
    for name, make in made:
        fig = make()
        if fig is None:
            continue
        path = out_dir / f"{name}.png"
        # atomic (a full disk leaves the old figure, not half a PNG); tight: long labels and the legend stay whole
        write_file_atomic(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
        plt.close(fig)
        written[name] = path
    return written


def caption(name: str, declared: Declarations | None = None) -> str:
    if name in FIGURES:
        return FIGURES[name][1]
    return next((spec.caption for _, spec in (declared or Declarations()).figures if spec.name == name), "")
