"""`python -m ablate collect`: the jobs of a real (tiny) sweep joined into tidy tables and one report."""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

from ablate.report.collect import UNITS, collect, main, storable

SUFFIXES = ("_s", "_ms", "_bytes", "_x", "_frac", "_tok", "_count", "_seqs", "_ppl", "_cpus", "_procs")
ERROR = "RuntimeError: CUDA out of memory (fabricated for the test)"


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory, compose_config, registry) -> Path:
    """results/ch08_kv_cache with two real jobs (num_requests 1 and 2; a one-value grid over
    prompt_len), a fabricated failed job (num_requests 16) and a folder that is not a run."""
    from ablate.experiment.job import run_job

    tmp = tmp_path_factory.mktemp("sweep")
    for num_requests in (1, 2):
        raw = compose_config(tmp, "+experiment=ch08_kv_cache", "model=tiny", "~experiment.arms.dynamic",
                             "wandb.mode=disabled", "experiment.repeats=3", "experiment.warmup=0",
                             "~experiment.grid.output_len", "+experiment.grid.prompt_len=[8]", "workload.prompt_len=8",
                             "workload.output_len=3", f"workload.num_requests={num_requests}")
        run_job(raw, registry)
    root = tmp / "results" / "ch08_kv_cache"
    done = sorted(p for p in root.iterdir() if p.is_dir())      # not the run folders' lock files
    failed = root / "fa11ed000000"
    shutil.copytree(done[0], failed)
    for name in ("done.json", "runs.csv", "summary.csv", "requests.csv"):
        (failed / name).unlink()
    config = json.loads((failed / "config.json").read_text())
    config["workload"]["num_requests"] = 16
    (failed / "config.json").write_text(json.dumps(config))
    (failed / "failed.json").write_text(json.dumps({"status": "failed", "error": ERROR, "traceback": "..."}))
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("not a run")
    return root


@pytest.fixture(scope="module")
def collected(sweep_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep = collect(sweep_root, out)
    return sweep, out, [str(w.message) for w in caught]


def job_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / "done.json").exists())


def test_runs_and_summary_hold_every_job_grid_point_arm_and_round(sweep_root, collected):
    sweep, _, _ = collected
    done = job_dirs(sweep_root)
    assert len(done) == 2
    originals = {p.name: pd.read_csv(p / "runs.csv") for p in done}
    # 1 grid point x 2 arms x 3 rounds per finished job, plus the failed job's one row
    assert all(len(frame) == 6 for frame in originals.values())
    assert len(sweep.runs) == 6 + 6 + 1
    assert len(sweep.summary) == 2 + 2 + 1
    assert sweep.runs.groupby("job").size().to_dict() == {**{p.name: 6 for p in done}, "fa11ed000000": 1}
    assert list(sweep.runs.columns[:4]) == ["job", "experiment", "status", "error"]
    columns = list(sweep.runs.columns)
    assert columns.index("config.workload.num_requests") < columns.index("arm") < columns.index("repeat") \
        < columns.index("prompt_len") < columns.index("duration_s")
    assert set(sweep.runs["experiment"]) == {"ch08_kv_cache"}
    for job, original in originals.items():
        rows = sweep.runs[sweep.runs["job"] == job]
        config = json.loads((sweep_root / job / "config.json").read_text())
        assert (rows["config.workload.num_requests"] == config["workload"]["num_requests"]).all()
        assert (rows["status"] == "done").all()
        assert rows["duration_s"].tolist() == original["duration_s"].tolist()
        assert sorted(set(rows["arm"])) == ["contiguous", "recompute"]
        assert sorted(rows["repeat"].tolist()) == [0, 0, 1, 1, 2, 2]


def test_swept_keys_are_the_config_keys_that_differ_and_the_grid_keys(collected):
    sweep, _, _ = collected
    assert sweep.swept == ["config.workload.num_requests", "prompt_len"]
    assert sweep.grid_keys == ["prompt_len"]
    assert sorted(sweep.summary["config.workload.num_requests"].unique()) == [1, 2, 16]
    assert set(sweep.summary["prompt_len"].dropna()) == {8}


def test_metrics_carry_their_unit_and_plugin_columns_their_name(sweep_root, collected):
    sweep, _, _ = collected
    for old, new in UNITS.items():
        assert old not in sweep.runs and old not in sweep.summary
    assert {"kv_util_mean_frac", "mbu_decode_frac", "mfu_frac", "tokens_per_emission_tok", "ttft_p99_ms",
            "peak_memory_bytes", "output_throughput_tok_s", "arm_status"} <= set(sweep.runs.columns)
    assert {"speedup_x", "speedup_ci_low_x", "speedup_ci_high_x", "kv_util_mean_frac"} <= set(sweep.summary.columns)
    assert "kv_cache.kv_slots" in sweep.runs      # a plugin's column keeps its name
    job = job_dirs(sweep_root)[0]
    original = pd.read_csv(job / "summary.csv")
    ours = sweep.summary[sweep.summary["job"] == job.name]
    assert ours["speedup_x"].tolist() == original["speedup"].tolist()
    assert ours["kv_util_mean_frac"].tolist() == pytest.approx(original["kv_util_mean"].tolist(), nan_ok=True)
    assert ours["arm_status"].tolist() == original["status"].tolist()
    identity = {"job", "experiment", "status", "error", "arm", "label", "repeat", *sweep.grid_keys}
    metrics = [c for c in sweep.runs.select_dtypes("number").columns if sweep.runs[c].notna().any()
               and c not in identity and not c.startswith("config.") and "." not in c]
    assert len(metrics) > 30
    unitless = [c for c in metrics if not c.endswith(SUFFIXES)]
    assert unitless == [], f"core metrics without a unit in their name: give them one in collect.UNITS {unitless}"


@pytest.mark.parametrize("table", ["runs", "summary"])
def test_parquet_holds_what_the_csv_holds(collected, table):
    sweep, out, _ = collected
    csv = pd.read_csv(out / f"sweep_{table}.csv")
    parquet = pd.read_parquet(out / f"sweep_{table}.parquet")
    assert parquet.shape == csv.shape == getattr(sweep, table).shape
    assert list(parquet.columns) == list(csv.columns)
    numeric = [c for c in csv.columns if pd.api.types.is_numeric_dtype(csv[c])]
    assert len(numeric) > 50
    pd.testing.assert_frame_equal(parquet[numeric], csv[numeric], check_dtype=False)
    for column in csv.columns.difference(numeric):     # text and flags, missing values alike
        assert [None if pd.isna(v) else v for v in parquet[column]] == \
            [None if pd.isna(v) else v for v in csv[column]], column
    assert csv.loc[csv["job"] == "fa11ed000000", "error"].tolist() == [ERROR]


def test_a_failed_job_is_one_row_with_its_error(collected):
    sweep, out, _ = collected
    for frame in (sweep.runs, sweep.summary):
        rows = frame[frame["job"] == "fa11ed000000"]
        assert len(rows) == 1
        row = rows.iloc[0]
        assert row["status"] == "failed" and row["error"] == ERROR
        assert row["config.workload.num_requests"] == 16 and pd.isna(row["arm"])
        assert frame.loc[frame["job"] != "fa11ed000000", "error"].isna().all()
    assert sweep.counts() == {"done": 2, "failed": 1, "running": 0}
    assert ERROR in (out / "sweep_report.md").read_text()


def test_a_folder_that_is_no_run_is_left_out_with_a_warning(sweep_root, collected):
    sweep, _, caught = collected
    assert [m for m in caught if str(sweep_root / "notes") in m and "not a run folder" in m]
    assert "notes" not in set(sweep.runs["job"])
    assert any("notes" in p for p in sweep.problems)


def test_the_report_has_a_figure_per_swept_key_with_more_than_one_value(collected):
    sweep, out, _ = collected
    text = (out / "sweep_report.md").read_text()
    figure = out / "sweep_workload.num_requests.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    assert "![workload.num_requests](sweep_workload.num_requests.png)" in text
    assert not (out / "sweep_prompt_len.png").exists()          # one value of the grid key: no figure
    assert "One measured value of `prompt_len`: no figure." in text
    assert sorted(p.name for p in out.glob("*.png")) == ["sweep_workload.num_requests.png"]
    assert "- `workload.num_requests`: 1, 2, 16" in text
    # the table: a row per num_requests x arm with the three metrics and their CIs
    section = text.split("## `workload.num_requests`")[1].split("![")[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and ("recompute" in line
                                                                               or "contiguous" in line)]
    assert len(rows) == 4 and all("tok/s [" in r and " ms [" in r and "x [" in r for r in rows)
    assert set(sweep.files) == {"sweep_runs.csv", "sweep_runs.parquet", "sweep_summary.csv",
                                "sweep_summary.parquet", "sweep_report.md", "sweep_workload.num_requests.png"}
    assert sorted(p.name for p in out.iterdir()) == sorted(sweep.files)      # no temporary file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o666 & ~umask for name in sweep.files}                   # an ordinary file's mode


def test_one_job_sweeps_nothing_and_draws_nothing(sweep_root, tmp_path):
    job = job_dirs(sweep_root)[0]
    shutil.copytree(job, tmp_path / "exp" / job.name)
    sweep = collect(tmp_path / "exp")
    assert sweep.swept == ["prompt_len"] and len(sweep.runs) == 6
    assert not list((tmp_path / "exp").glob("*.png"))
    assert (tmp_path / "exp" / "sweep_runs.parquet").exists()


def test_a_job_without_done_or_failed_is_running_and_a_superseded_one_is_left_out(sweep_root, tmp_path):
    job = job_dirs(sweep_root)[0]
    shutil.copytree(job, tmp_path / "exp" / job.name)
    shutil.copytree(job, tmp_path / "exp" / f"{job.name}.old-20250101-120000")      # moved aside by redo=true
    (tmp_path / "exp" / job.name / "done.json").unlink()
    with pytest.warns(UserWarning, match="moved aside by a redo"):
        sweep = collect(tmp_path / "exp", write=False)
    assert sweep.counts() == {"done": 0, "failed": 0, "running": 1}
    assert len(sweep.runs) == 6 and set(sweep.runs["status"]) == {"running"}


def test_a_corrupt_csv_is_named_in_a_warning_not_a_crash(sweep_root, tmp_path):
    job = job_dirs(sweep_root)[1]
    copy = tmp_path / "exp" / job.name
    shutil.copytree(job, copy)
    (copy / "runs.csv").write_text("arm,label,repeat\nbase,a,0\nbase,a,1,9,9,9\n")
    with pytest.warns(UserWarning, match=f"{copy / 'runs.csv'}: corrupt CSV"):
        sweep = collect(tmp_path / "exp", write=False)
    assert len(sweep.runs) == 1 and sweep.runs["arm"].isna().all()    # the job is still there
    assert len(sweep.summary) == 2                                    # its summary was readable
    assert not (tmp_path / "exp" / "sweep_runs.csv").exists()


def test_the_cli_prints_where_how_many_and_what_was_swept(sweep_root, tmp_path, capsys, monkeypatch):
    from ablate import cli

    monkeypatch.setattr(sys, "argv", ["ablate", "collect", str(sweep_root), "--out", str(tmp_path / "o")])
    cli.main()
    out = capsys.readouterr()
    assert "3 jobs: 2 done, 1 failed" in out.out
    assert "swept: config.workload.num_requests, prompt_len" in out.out
    assert f"report: {tmp_path / 'o' / 'sweep_report.md'}" in out.out
    assert "notes: not a run folder" in out.err
    assert (tmp_path / "o" / "sweep_summary.parquet").exists()


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "missing", "does not exist"),
    (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "is a file"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "holds no run folder"),
])
def test_a_bad_path_is_one_clear_line_and_exit_code_2(tmp_path, capsys, make, says):
    path = make(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert str(path) in err and says in err and "results/<experiment>" in err and "Traceback" not in err


def test_columns_mixing_numbers_and_text_are_stored_as_text():
    frame = pd.DataFrame({"mixed": [1, "a", None], "numbers": [1, 2.5, None], "empty": [None, None, None]})
    stored = storable(frame.astype(object))
    assert stored["mixed"].tolist()[:2] == ["1", "a"] and pd.isna(stored["mixed"].iloc[2])
    assert stored["numbers"].tolist()[:2] == [1, 2.5]
    assert stored["empty"].dtype == float


def synthetic_points(key: str, values: list) -> pd.DataFrame:
    rows = []
    for i, value in enumerate(values):
        for a, arm in enumerate(["base", "cache", "paged"]):
            for other in (1, 2):
                centre = 1.0 + 0.2 * a * (i + 1) / other
                rows.append({key: value, "config.workload.seed": other, "arm": arm, "speedup_x": centre,
                             "speedup_x_low": centre * 0.9, "speedup_x_high": centre * 1.1,
                             "output_throughput_tok_s": 100 * centre, "ttft_p99_ms": 10 / centre})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("values, log2", [([1, 4, 16], True), (["open", "quote"], False)])
def test_a_figure_has_a_line_per_arm_and_other_key_and_its_legend_beside_the_data(values, log2):
    from ablate.report.sweep_plots import key_figure, key_table

    key = "config.workload.num_requests" if log2 else "config.workload.prompt_kind"
    table = synthetic_points(key, values)
    swept = [key, "config.workload.seed"]
    fig = key_figure(table, swept, key)
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["speedup over the baseline (x)", "output throughput (tokens / s)",
                                                "TTFT p99 (ms)"]
    assert (axes[0].get_xscale() == "log") == log2
    assert len(axes[1].containers) == 3 * 2            # an error-bar line per arm x seed
    colours = {c.lines[0].get_color() for c in axes[1].containers}
    markers = {c.lines[0].get_marker() for c in axes[1].containers}
    assert len(colours) == 3 and len(markers) == 3    # each arm its own colour and marker
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["base", "cache", "paged", "workload.seed=1", "workload.seed=2"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in axes)
    shown = key_table(table, swept, key)
    assert len(shown) == len(table) and shown.iloc[0]["speedup over the baseline [95% CI]"] == "1.00x [0.90, 1.10]"
    assert key_figure(table[table[key] == values[0]], swept, key) is None     # one value: no figure


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "its config.json is not a JSON object (it holds a list)"),
    ('"text"', "its config.json is not a JSON object (it holds a str)"),
    ("42", "its config.json is not a JSON object (it holds a int)"),
    ('{"model": ', "config.json: unreadable (JSONDecodeError"),
])
def test_run_folders_whose_config_is_unreadable_are_named_not_called_no_run(tmp_path, capsys, content, says):
    run = tmp_path / "exp" / "0123abcd"
    run.mkdir(parents=True)
    (run / "config.json").write_text(content)
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("ignore")
        main([str(tmp_path / "exp")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "holds no readable run" in err and says in err and "holds no run folder" not in err
