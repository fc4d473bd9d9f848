"""`python -m ablate repro`: the agreement of speedups over fresh processes (ablate/report/repro.py),
on constructed summaries, and the command end to end on a tiny random model (slow)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from ablate.analysis.stats import Interval
from ablate.report.repro import AGREE, agreement, closing_line, console_table, main, needed_widening
from ablate.results import runs_under


def summary(speedup: float, low: float, high: float, status: str = "ok", noisy: object = False,
            output_len: int = 16) -> pd.DataFrame:
    """One process's summary.csv as read back: the baseline and one arm at one grid point."""
    row = {"output_len": output_len, "status": status, "speedup_rounds": 5, "speedup_note": math.nan,
           "duration_cv": 0.02}
    return pd.DataFrame([row | {"arm": "recompute", "speedup": 1.0, "speedup_ci_low": 1.0, "speedup_ci_high": 1.0,
                                "status": "ok", "noisy": False},
                         row | {"arm": "contiguous", "speedup": speedup, "speedup_ci_low": low,
                                "speedup_ci_high": high, "noisy": noisy}])


def verdicts(summaries: list[pd.DataFrame]) -> pd.DataFrame:
    return agreement(summaries, ["output_len"], baseline="recompute")


def test_processes_whose_intervals_hold_the_pooled_centre_agree():
    table = verdicts([summary(2.00, 1.90, 2.10), summary(2.05, 1.95, 2.15), summary(1.98, 1.90, 2.06)])
    assert list(table["arm"]) == ["contiguous"]            # the baseline against itself is no speedup
    (row,) = table.to_dict("records")
    assert row["verdict"] == AGREE
    centre = math.exp((math.log(2.00) + math.log(2.05) + math.log(1.98)) / 3)
    assert row["geomean"] == pytest.approx(centre)
    assert row["geomean_ci_low"] < centre < row["geomean_ci_high"]
    assert row["max_over_min"] == pytest.approx(2.05 / 1.98)
    within = [math.sqrt(2.10 / 1.90) - 1, math.sqrt(2.15 / 1.95) - 1, math.sqrt(2.06 / 1.90) - 1]
    assert row["within_half_width"] == pytest.approx(sum(within) / 3)
    assert row["widening"] < 1
    assert [row[f"status_p{i}"] for i in (1, 2, 3)] == ["ok", "ok", "ok"]


def test_tight_intervals_that_exclude_the_pooled_centre_disagree_by_how_much():
    table = verdicts([summary(2.00, 1.98, 2.02), summary(2.50, 2.45, 2.55), summary(2.20, 2.18, 2.22)])
    (row,) = table.to_dict("records")
    centre = (2.00 * 2.50 * 2.20) ** (1 / 3)
    # the first process sits furthest below the centre in units of its own upper half-width
    widening = max(math.log(centre / 2.00) / math.log(2.02 / 2.00), math.log(2.50 / centre) / math.log(2.50 / 2.45),
                   abs(math.log(2.20 / centre)) / math.log((2.22 if centre > 2.20 else 2.20) /
                                                           (2.20 if centre > 2.20 else 2.18)))
    assert row["widening"] == pytest.approx(widening)
    assert row["verdict"] == f"disagree: the within-run intervals understate the run-to-run spread by {widening:.1f}x"
    assert "do not agree" in closing_line(table, 3) and "1 disagree" in closing_line(table, 3)


def test_an_interval_reaching_the_centre_exactly_agrees_and_one_of_zero_width_never_does():
    assert needed_widening([Interval(2.0, 1.0, 4.0, 5)], 4.0) == pytest.approx(1.0)
    assert needed_widening([Interval(2.0, 1.0, 4.0, 5)], 1.0) == pytest.approx(1.0)
    assert needed_widening([Interval(2.0, 2.0, 2.0, 5)], 2.0) == 0
    assert needed_widening([Interval(2.0, 2.0, 2.0, 5)], 2.1) == math.inf


@pytest.mark.parametrize(("broken", "status"), [
    (summary(math.nan, math.nan, math.nan, status="failed"), "failed"),
    (summary(2.0, 1.9, 2.1, noisy="True"), "noisy"),          # the contention flag, as read from a CSV
    (summary(math.nan, math.nan, math.nan, status="noisy"), "noisy"),
    (summary(2.0, math.nan, math.nan), "no interval (no speedup)"),
])
def test_an_arm_not_ok_in_one_process_is_not_comparable(broken, status):
    table = verdicts([summary(2.0, 1.9, 2.1), broken, summary(2.0, 1.9, 2.1)])
    (row,) = table.to_dict("records")
    assert row["status_p2"] == status
    assert row["verdict"] == f"not comparable: {status} in process 2"
    assert "geomean" not in row or pd.isna(row["geomean"])     # no pooled speedup of what was not measured
    assert "not comparable" in closing_line(table, 3)
    shown = console_table(table, ["output_len"])
    assert status.upper() in shown or "no interval" in shown


def test_an_arm_missing_from_a_process_or_a_grid_point_is_reported_as_missing():
    table = verdicts([pd.concat([summary(2.0, 1.9, 2.1), summary(3.0, 2.9, 3.1, output_len=32)]),
                      summary(2.0, 1.9, 2.1)])
    assert list(table["output_len"]) == [16, 32]
    assert table.loc[0, "verdict"] == AGREE
    assert table.loc[1, "verdict"] == "not comparable: missing in process 2"


def test_statuses_are_grouped_by_the_processes_they_happened_in():
    table = verdicts([summary(math.nan, math.nan, math.nan, status="failed"), summary(2.0, 1.9, 2.1, noisy=True),
                      summary(math.nan, math.nan, math.nan, status="failed")])
    assert table.loc[0, "verdict"] == "not comparable: failed in processes 1 and 3; noisy in process 2"


def test_the_console_table_shows_each_process_the_spread_and_the_verdict():
    table = verdicts([summary(2.00, 1.90, 2.10), summary(2.05, 1.95, 2.15), summary(1.98, 1.90, 2.06)])
    lines = console_table(table, ["output_len"]).splitlines()
    assert all(name in lines[0] for name in ("process 1", "process 3", "over processes", "max/min", "within-run ±"))
    assert "2.00x [1.90, 2.10]" in lines[1] and lines[1].rstrip().endswith(AGREE)
    assert closing_line(table, 3).startswith("all 1 speedups agree across 3 processes")


@pytest.mark.parametrize(("argv", "says"), [
    (["--processes", "1", "kv_cache=contiguous"], "at least 2"),
    (["kv_cache=contiguous", "redo=false"], "repro sets redo"),
])
def test_bad_input_is_refused_before_anything_runs(argv, says, tmp_path):
    with pytest.raises(ValueError, match=says):
        main([*argv, "--out", str(tmp_path / "repro")])
    assert not (tmp_path / "repro").exists()


def test_a_folder_that_already_holds_files_is_refused(tmp_path):
    (tmp_path / "old.csv").write_text("x\n")
    with pytest.raises(ValueError, match="already holds files"):
        main(["kv_cache=contiguous", "--out", str(tmp_path)])


@pytest.mark.slow       # one `python -m ablate` process, refused before it measures
def test_a_config_the_first_process_refuses_is_bad_input_and_nothing_more_runs(tmp_path):
    with pytest.raises(ValueError, match=r"process 1 refused the experiment: experiment.repeats must be >= 1"):
        main(["--out", str(tmp_path), "kv_cache=contiguous", "experiment.repeats=-1", "device=cpu"])
    assert not any(tmp_path.glob("process2*"))


QUICK = ["model=tiny", "model.init=random", "experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2",
         "workload.prompt_len=8", "workload.output_len=4", "wandb.mode=disabled", "device=cpu", "threads=1",
         "peak_bandwidth=1e10", "peak_flops=1e11"]     # benchmarks/bad_inputs.py's QUICK: a tiny, quick run


@pytest.mark.slow
def test_repro_measures_each_process_afresh_and_writes_its_table(tmp_path):
    out = tmp_path / "repro"
    done = subprocess.run([sys.executable, "-m", "ablate", "repro", "--processes", "2", "--out", str(out),
                           "kv_cache=contiguous", *QUICK], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    runs = [runs_under(out / f"process{i}") for i in (1, 2)]
    assert [len(r) for r in runs] == [1, 1] and runs[0][0] != runs[1][0]
    for i in (1, 2):      # each process measured: nothing was skipped as already finished
        assert "already finished" not in (out / f"process{i}.log").read_text()
    table = pd.read_csv(out / "repro.csv")
    records = json.loads((out / "repro.json").read_text())
    assert list(table["arm"]) == [r["arm"] for r in records] == ["kv_cache=contiguous"]
    (row,) = table.to_dict("records")
    for i in (1, 2):
        summary_row = pd.read_csv(runs[i - 1][0] / "summary.csv").set_index("arm").loc["kv_cache=contiguous"]
        assert row[f"speedup_p{i}"] == pytest.approx(summary_row["speedup"], nan_ok=True)
    agreed = row["verdict"] == AGREE
    assert done.returncode == (0 if agreed else 1)
    assert ("all 1 speedups agree" if agreed else "do not agree") in done.stdout.splitlines()[-1]
    assert "process 1" in done.stdout and "process 2" in done.stdout
