"""The figures a person reads: CIs on latency and goodput from the rounds, SLOs as lines, every arm
its own colour and marker, legends beside the axes, names under bars cut, and no line of one x."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.container import ErrorbarContainer

from ablate.analysis.stats import log_interval
from ablate.report import plots
from ablate.report.plots import Layout, draw, with_run_columns
from test_report import legend_labels, summary_frame


def rounds_of(summary: pd.DataFrame, point_keys: list[str], n: int = 3) -> pd.DataFrame:
    """n rounds per grid point and arm around the summary's latency and goodput (+-5%, +-10%)."""
    rows = []
    for _, row in summary.iterrows():
        for r, f in enumerate(np.linspace(0.9, 1.1, n)):
            rows.append({**{k: row[k] for k in point_keys}, "arm": row["arm"], "repeat": r, "status": "ok",
                         **{c: row[c] * f for c in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                                    "output_throughput_tok_s")},
                         "goodput_req_s": 2.0 * f})
    return pd.DataFrame(rows)


def errorbar_spans(ax) -> list[tuple[float, float]]:
    spans = []
    for c in ax.containers:
        if isinstance(c, ErrorbarContainer) and c.has_yerr:
            (bars,) = c.lines[2]
            spans += [(seg[:, 1].min(), seg[:, 1].max()) for seg in bars.get_segments()]
    return sorted(spans)


def test_latency_has_cis_from_the_rounds_and_slo_lines():
    summary = summary_frame({"rate": [1.0, 2.0, 4.0]})
    runs = rounds_of(summary, ["rate"])
    frame = with_run_columns(summary, runs, ["rate"])
    fig = plots.latency_figure(frame, Layout.of(frame, ["rate"]), slo={"ttft": 15.0, "tpot": None})
    ttft, tpot = fig.axes
    cache = runs[(runs["arm"] == "cache") & (runs["rate"] == 1.0)]
    ci = log_interval(cache["ttft_p50_ms"])
    assert any(np.allclose(span, (ci.low, ci.high)) for span in errorbar_spans(ttft))
    assert len(errorbar_spans(ttft)) == 2 * 2 * 3       # p50 and p99, two arms, three rates
    slo_lines = [line for line in ttft.get_lines() if list(line.get_ydata()) == [15.0, 15.0]]
    assert len(slo_lines) == 1 and not [line for line in tpot.get_lines() if line.get_linestyle() == "-."]
    assert "TTFT SLO 15 ms" in legend_labels(fig)


def test_goodput_has_cis_and_names_the_slos(tmp_path):
    summary = summary_frame({"rate": [1.0, 2.0]}, goodput_req_s=lambda n, i: 2.0)
    runs = rounds_of(summary, ["rate"])
    frame = with_run_columns(summary, runs, ["rate"])
    fig = plots.goodput_figure(frame, Layout.of(frame, ["rate"]), slo={"ttft": 200.0, "tpot": 50.0})
    (ax,) = fig.axes
    assert len(errorbar_spans(ax)) == 4 and "TTFT <= 200 ms, TPOT <= 50 ms" in ax.get_title()
    # with the TTFT SLO alone too: its own series (dashed) with CIs over the rounds, named in the legend
    runs["goodput_ttft_req_s"] = 3.0 * runs["goodput_req_s"]
    frame = with_run_columns(summary.assign(goodput_ttft_req_s=6.0), runs, ["rate"])
    fig = plots.goodput_figure(frame, Layout.of(frame, ["rate"]), slo={"ttft": 200.0, "tpot": 50.0})
    ci = log_interval(runs[(runs["arm"] == "cache") & (runs["rate"] == 1.0)]["goodput_ttft_req_s"])
    assert len(errorbar_spans(fig.axes[0])) == 8
    assert any(np.allclose(span, (ci.low, ci.high)) for span in errorbar_spans(fig.axes[0]))
    assert {"every SLO set", "TTFT SLO alone"} <= set(legend_labels(fig))
    figures = draw(summary, ["rate"], tmp_path, runs, ttft_slo_ms=200.0)
    assert {"latency", "goodput"} <= set(figures)


def test_a_grid_of_one_point_gets_bars_never_a_line_of_one_x(tmp_path):
    summary = summary_frame({"output_len": [64]}, arms=("mha", "gqa", "mqa"),
                            seqs_admitted_max=lambda n, i: 4.0, kv_used_peak_bytes=lambda n, i: 1000.0,
                            kv_bytes_per_token=lambda n, i: 1024.0 / 2**i, perplexity=lambda n, i: 10.0 + i)
    layout = Layout.of(summary, ["output_len"])
    assert layout.x_key is None
    for name, (make, _) in plots.FIGURES.items():
        fig = make(summary, layout, None)
        if fig is None:
            continue
        for ax in fig.axes:
            lines = [line for line in ax.get_lines() if line.get_linestyle() not in ("None", "none", "--", "-.")
                     and len(line.get_xdata()) >= 1 and line.get_marker() not in ("None", "", None)]
            assert not lines, f"{name}: a line plot of one x value"
    figures = draw(summary, ["output_len"], tmp_path)
    assert "memory_vs_concurrency" in figures                 # the bytes-per-token panel alone
    fig = plots.memory_vs_concurrency_figure(summary, layout)
    assert len(fig.axes) == 1 and "KV bytes per token" in fig.axes[0].get_title()


def test_every_arm_has_its_own_colour_and_marker_and_the_legend_is_beside_the_axes():
    arms = tuple(f"arm_{i}" for i in range(12))
    frame = summary_frame({"output_len": [16, 64]}, arms=arms)
    layout = Layout.of(frame, ["output_len"])
    styles = [(line.colour, line.marker) for line in layout.lines(frame)]
    assert len(set(styles)) == len(arms) and len({c for c, _ in styles}) == len(arms)
    fig = plots.throughput_figure(frame, layout)
    fig.canvas.draw()
    (ax,), (legend,) = fig.axes, fig.legends
    assert legend_labels(fig)[:12] == list(arms)
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1      # right of the axes, not over them


def test_long_arm_names_under_bars_are_cut_and_stay_apart():
    arms = ("baseline", "kv_cache=paged,block_size=16,attention=flash_decoding",
            "kv_cache=paged,block_size=32,attention=flash_decoding")
    frame = summary_frame({}, arms=arms)
    fig = plots.throughput_figure(frame, Layout.of(frame, []))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[0] == "baseline" and all(len(label) <= 24 for label in labels) and len(set(labels)) == 3
