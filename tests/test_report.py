"""The report: which figures are drawn for which results, their axes, legends and CIs, the Markdown
page, `python -m ablate.report.page`, and a job's figures logged to W&B as images."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer

from ablate.analysis.stats import log_interval
from ablate.report import plots
from ablate.report.declared import Declarations
from ablate.report.page import main as report_main
from ablate.report.page import markdown, write_report
from ablate.report.plots import Layout, draw, with_run_columns
from ablate.report.tables import summary_table
from ablate.results import RunFolder
from ablate_decoding.speculative import Speculative

SPECULATIVE = Declarations.of([Speculative])    # what a speculative arm's plugin declares

PNG = b"\x89PNG\r\n\x1a\n"


def summary_frame(grid: dict[str, list], arms=("base", "cache"), **columns) -> pd.DataFrame:
    """One row per grid point x arm: the baseline at speedup 1 [1, 1], other arms 2x [1.5, 2.5] times
    their index, and any further `columns` given as a function of (row index, arm index)."""
    keys = list(grid)
    points = pd.MultiIndex.from_product(list(grid.values()), names=keys).to_frame(index=False) if keys else \
        pd.DataFrame(index=[0])
    rows = []
    for _, point in points.iterrows():
        for i, arm in enumerate(arms):
            speedup = 1.0 if i == 0 else 2.0 * i
            row = {**point.to_dict(), "arm": arm, "label": arm, "speedup": speedup,
                   "speedup_ci_low": 1.0 if i == 0 else speedup - 0.5,
                   "speedup_ci_high": 1.0 if i == 0 else speedup + 0.5,
                   "predicted_speedup": 1.0 if i == 0 else speedup * 1.2, "duration_cv": 0.02, "unstable": False,
                   "output_throughput_tok_s": 100.0 * (i + 1), "peak_memory_bytes": 2**20 * (1 + i),
                   "kv_reserved_peak_bytes": 2**19 * i, "ttft_p50_ms": 10.0 + i, "ttft_p99_ms": 20.0 + i,
                   "tpot_p50_ms": 5.0 + i, "tpot_p99_ms": 9.0 + i}
            row |= {name: make(len(rows), i) for name, make in columns.items()}
            rows.append(row)
    return pd.DataFrame(rows)


def legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


# four sets of figures drawn (~5 s); drawing in the default run: test_write_report_returns_the_figures_it_references
@pytest.mark.slow
def test_figures_follow_the_columns_present(tmp_path):
    plain = summary_frame({"output_len": [16, 64, 256]})
    assert list(draw(plain, ["output_len"], tmp_path / "plain")) == ["speedup", "throughput", "latency", "memory"]

    speculative = summary_frame({"prompt_kind": ["quote", "open"]}, arms=("ar", "ngram_k2", "ngram_k4"),
                                **{"decoding.k": lambda n, i: np.nan if i == 0 else 2.0 * i,
                                   "decoding.alpha": lambda n, i: np.nan if i == 0 else 0.5,
                                   "decoding.predicted_speedup": lambda n, i: np.nan if i == 0 else 1.5})
    assert "acceptance" not in draw(speculative, ["prompt_kind"], tmp_path / "undeclared")   # nobody declared it
    figures = draw(speculative, ["prompt_kind"], tmp_path / "spec", declared=SPECULATIVE)
    assert {"acceptance", "speculative_speedup"} <= set(figures)

    variants = summary_frame({}, arms=("mha", "gqa", "mqa"), seqs_admitted_max=lambda n, i: 2.0 ** (i + 1),
                             kv_used_peak_bytes=lambda n, i: 1000.0 * i, perplexity=lambda n, i: 10.0 + i,
                             kv_bytes_per_token=lambda n, i: 1024.0 / 2**i)
    figures = draw(variants, [], tmp_path / "variants")
    assert {"memory_vs_concurrency", "kv_vs_perplexity"} <= set(figures) and "acceptance" not in figures
    for path in [*figures.values()]:
        assert path.read_bytes().startswith(PNG)
    assert draw(plain.iloc[0:0], ["output_len"], tmp_path / "empty") == {}


def test_speedup_figure_axes_legend_and_confidence_intervals():
    frame = summary_frame({"output_len": [16, 64, 256]}, arms=("recompute", "contiguous", "dynamic"))
    fig = plots.speedup_figure(frame, Layout.of(frame, ["output_len"]))
    (ax,) = fig.axes
    assert ax.get_xlabel() == "output length (tokens)" and ax.get_xscale() == "log"   # 16..256 spans 16x
    assert list(ax.get_xticks()) == [16, 64, 256]
    assert "speedup" in ax.get_ylabel()
    labels = legend_labels(fig)
    assert {"contiguous", "dynamic", "baseline: recompute"} <= set(labels) and "recompute" not in labels
    # the first series with error bars is the contiguous arm's measured speedup
    first = next(c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.has_yerr)
    (bars,) = first.lines[2]
    spans = sorted((seg[:, 1].min(), seg[:, 1].max()) for seg in bars.get_segments())
    arm = frame[frame["arm"] == "contiguous"]
    assert spans == sorted(zip(arm["speedup_ci_low"], arm["speedup_ci_high"]))


def test_latency_against_request_rate_has_a_panel_per_quantity():
    frame = summary_frame({"rate": [0.5, 1.0, 2.0, 4.0]})
    fig = plots.latency_figure(frame, Layout.of(frame, ["rate"]))
    assert [ax.get_ylabel() for ax in fig.axes] == ["TTFT (ms)", "TPOT (ms)"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"request rate (requests / s)"}
    assert {"p50", "p99", "base", "cache"} <= set(legend_labels(fig))
    # p50 solid, p99 dashed, for every arm
    styles = {line.get_linestyle() for line in fig.axes[0].get_lines() if len(line.get_xdata()) == 4}
    assert styles == {"-", "--"}


def test_a_second_grid_key_sets_the_markers_and_categories_stay_categories():
    frame = summary_frame({"output_len": [16, 64], "prompt_len": [32, 128]})
    layout = Layout.of(frame, ["output_len", "prompt_len"])
    assert (layout.x_key, layout.marker_keys) == ("output_len", ["prompt_len"])
    lines = list(layout.lines(frame))
    assert [line.label for line in lines][:2] == ["base, prompt_len=32", "base, prompt_len=128"]
    assert len({line.marker for line in lines}) == 2 and len({line.colour for line in lines}) == 2

    kinds = summary_frame({"prompt_kind": ["quote", "open"]})
    fig = plots.throughput_figure(kinds, Layout.of(kinds, ["prompt_kind"]))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["quote", "open"]


def test_run_columns_add_throughput_cis_and_perplexity():
    summary = summary_frame({"output_len": [16]})
    runs = pd.DataFrame({"output_len": 16, "arm": ["base"] * 3 + ["cache"] * 3, "repeat": [0, 1, 2] * 2,
                         "output_throughput_tok_s": [90.0, 100.0, 110.0, 190.0, 200.0, 210.0],
                         "perplexity": [12.0] * 3 + [13.0] * 3})
    frame = with_run_columns(summary, runs, ["output_len"]).set_index("arm")
    assert frame.loc["cache", "perplexity"] == 13.0
    ci = log_interval([190.0, 200.0, 210.0])       # the t-interval on logs over the rounds
    assert (frame.loc["cache", "output_throughput_tok_s_ci_low"], frame.loc["cache", "output_throughput_tok_s_ci_high"]) \
        == pytest.approx((ci.low, ci.high))
    assert ci.low < 190 and ci.high > 210          # wider than the values' range at three rounds


def test_markdown_has_the_tables_the_results_call_for_and_the_noise_warnings():
    frame = summary_frame({}, arms=("ar", "ngram_k2"), **{"decoding.k": lambda n, i: np.nan if i == 0 else 2.0,
                                                          "decoding.alpha": lambda n, i: np.nan if i == 0 else 0.6,
                                                          "decoding.drafter": lambda n, i: None if i == 0 else "ngram"})
    frame.loc[1, ["duration_cv", "unstable"]] = [0.25, True]
    text = markdown("ch11", frame, [], ["a note"], {"speedup": Path("speedup.png")}, declared=SPECULATIVE)
    assert text.startswith("# ch11\n") and "## Speculative decoding" in text and "| ngram_k2 |" in text
    assert "## KV bytes" not in text
    assert "- a note" in text and "- ngram_k2: run times varied 25% between rounds" in text
    assert "![speedup](speedup.png)" in text and "*Speedup of each arm" in text


def experiment_folder(root: Path, name: str) -> RunFolder:
    """A finished experiment run folder with a grid over output_len."""
    summary = summary_frame({"output_len": [8, 16]})
    runs = summary[["output_len", "arm", "output_throughput_tok_s"]].assign(repeat=0)
    folder = RunFolder(root / "ch08_kv_cache" / name)
    folder.start({"experiment": {"name": "ch08_kv_cache", "grid": {"output_len": [8, 16]}}}, {"device": "cpu"})
    folder.write_table("summary", summary)
    folder.write_table("runs", runs)
    folder.finish("done")
    return folder


def test_report_cli_redraws_experiment_runs_and_leaves_table_jobs_alone(tmp_path, capsys):
    run = experiment_folder(tmp_path, "abc")
    table_job = RunFolder(tmp_path / "ch07_costs" / "def")
    table_job.start({"experiment": {"name": "ch07_costs"}}, {"device": "cpu"})
    table_job.write_table("costs", pd.DataFrame({"model": ["x"]}))
    table_job.write_text("report.md", "# costs\n")
    table_job.finish("done")

    report_main([str(tmp_path)])
    out = capsys.readouterr().out
    assert str(run.path / "report.md") in out and "not an experiment run" in out
    text = (run.path / "report.md").read_text()
    assert text.startswith("# ch08_kv_cache") and "![speedup](speedup.png)" in text
    assert (run.path / "speedup.png").read_bytes().startswith(PNG)
    assert (table_job.path / "report.md").read_text() == "# costs\n"
    with pytest.raises(SystemExit, match="no finished runs"):
        report_main([str(tmp_path / "nothing")])


def test_write_report_returns_the_figures_it_references(tmp_path):
    summary = summary_frame({"rate": [1.0, 2.0]})
    report, figures = write_report(tmp_path, summary, ["rate"], "ch10", [])
    text = report.read_text()
    assert list(figures) == ["speedup", "throughput", "latency", "memory"]
    assert all(f"![{name}]({path.name})" in text and path.exists() for name, path in figures.items())


@pytest.mark.slow   # a whole job over a grid of two points, logged to W&B offline
def test_a_job_writes_its_figures_and_logs_each_to_wandb(compose_config, registry, tmp_path):
    from ablate.experiment.job import run_job

    raw = compose_config(tmp_path, "kv_cache=contiguous", "wandb.mode=offline", "experiment.repeats=2",
                         "experiment.warmup=0", "workload.num_requests=2", "workload.prompt_len=8",
                         "+experiment.grid.output_len=[2,4]")
    folder = run_job(raw, registry)
    text = (folder.path / "report.md").read_text()
    drawn = [p.stem for p in folder.path.glob("*.png")]
    assert {"speedup", "throughput", "latency", "memory"} <= set(drawn)
    assert all(f"![{name}]({name}.png)" in text for name in drawn)
    wandb_dir = Path(json.loads((folder.path / "done.json").read_text())["wandb_dir"])
    logged = {p.name.rsplit("_", 2)[0] for p in (wandb_dir / "files" / "media" / "images").glob("*.png")}
    assert logged == set(drawn)


def test_a_ttft_slo_adds_its_goodput_and_attainment_columns():
    plain = summary_frame({"rate": [1.0]}, goodput_req_s=lambda n, i: 1.0)
    assert "TTFT-SLO goodput req/s" not in summary_table(plain, ["rate"])
    slo = summary_frame({"rate": [1.0]}, goodput_req_s=lambda n, i: 1.0 + i,
                        goodput_ttft_req_s=lambda n, i: 1.5 + i, ttft_slo_attained=lambda n, i: 0.75 + 0.25 * i)
    table = summary_table(slo, ["rate"])
    assert table["goodput req/s"].tolist() == ["1.00", "2.00"]
    assert table["TTFT-SLO goodput req/s"].tolist() == ["1.50", "2.50"]
    assert table["TTFT SLO met"].tolist() == ["75%", "100%"]
