"""`python -m ablate compare`: two run folders side by side, their config and environment
differences, and a verdict per metric that follows the Welch t CI of B / A on logs."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ablate.report.compare import compare, differences, main
from ablate.results import RunFolder

ENV = {"device": "cpu", "git_commit": "aaaa", "python": "3.11.7", "versions": {"torch": "2.13.0"}}


def run_folder(root, name: str, durations: dict[str, list[float]], *, output_len: int = 32,
               env: dict | None = None) -> RunFolder:
    """A finished run folder holding runs.csv for arms `slow` (the baseline, run first) and `fast`.

    config.json lists the arms in sorted order, as the results store writes it, so that the first
    arm there (`fast`) is not the baseline: compare must take the baseline from runs.csv."""
    config = {"experiment": {"name": "exp", "baseline": "", "grid": {"output_len": [output_len]},
                             "arms": {"fast": {}, "slow": {}}},
              "workload": {"prompt_len": 16, "output_len": output_len}, "results_dir": str(root)}
    rows = []
    for repeat in range(len(durations["slow"])):
        for arm in ("slow", "fast") if repeat % 2 == 0 else ("fast", "slow"):
            seconds = durations[arm][repeat]
            rows.append({"output_len": output_len, "arm": arm, "repeat": repeat, "duration_s": seconds,
                         "output_throughput_tok_s": output_len / seconds, "peak_memory_bytes": 1000.0})
    folder = RunFolder(root / name)
    folder.start(config, env or ENV)
    folder.write_table("runs", pd.DataFrame(rows))
    folder.finish("done")
    return folder


def row(table: pd.DataFrame, arm: str, metric: str) -> pd.Series:
    (index,) = table.index[(table["arm"] == arm) & (table["metric"] == metric)]
    return table.loc[index]


def test_the_same_measurements_are_within_noise(tmp_path):
    times = {"slow": [2.0, 2.2, 1.9, 2.1], "fast": [1.0, 1.1, 0.9, 1.05]}
    a, b = run_folder(tmp_path, "a", times), run_folder(tmp_path, "b", times)
    table = compare(a.path, b.path)
    assert set(table["verdict"]) == {"within noise"}
    np.testing.assert_allclose(table["B/A"], 1.0)
    speedup = row(table, "fast", "speedup")           # per round: slow / fast, the baseline taken from runs.csv
    ratios = np.array(times["slow"]) / times["fast"]
    assert speedup["A"] == pytest.approx(np.exp(np.log(ratios).mean()))          # the geometric mean
    assert not ((table["arm"] == "slow") & (table["metric"] == "speedup")).any()   # the baseline vs itself


def test_a_real_slowdown_is_beyond_noise_and_a_shared_one_leaves_speedup_alone(tmp_path):
    a = run_folder(tmp_path, "a", {"slow": [2.0, 2.1, 1.95, 2.05], "fast": [1.0, 1.02, 0.98, 1.01]})
    # B: the fast arm 1.5x slower in every round; the baseline unchanged
    b = run_folder(tmp_path, "b", {"slow": [2.0, 2.1, 1.95, 2.05], "fast": [1.5, 1.53, 1.47, 1.52]})
    table = compare(a.path, b.path)
    duration = row(table, "fast", "duration_s")
    assert duration["B/A"] == pytest.approx(1.5, rel=0.02) and duration["verdict"] == "beyond noise"
    assert duration["ci_low"] > 1
    assert row(table, "fast", "speedup")["verdict"] == "beyond noise"
    assert row(table, "slow", "duration_s")["verdict"] == "within noise"
    assert row(table, "fast", "peak_memory_bytes")["verdict"] == "within noise"     # equal constants

    # C: the whole machine 1.5x slower: both arms' times change, their per-round ratio does not
    c = run_folder(tmp_path, "c", {"slow": [3.0, 3.15, 2.925, 3.075], "fast": [1.5, 1.53, 1.47, 1.515]})
    table = compare(a.path, c.path)
    assert row(table, "fast", "duration_s")["verdict"] == "beyond noise"
    assert row(table, "fast", "speedup")["verdict"] == "within noise"


@pytest.mark.parametrize("repeats", [1, 2])
def test_too_few_repeats_claim_nothing(tmp_path, repeats):
    # at n=2 the old bootstrap called a TTFT ratio "beyond noise" with CI [0.032, 0.976]
    a = run_folder(tmp_path, "a", {"slow": [2.0, 2.1][:repeats], "fast": [1.0, 1.01][:repeats]})
    b = run_folder(tmp_path, "b", {"slow": [2.0, 2.1][:repeats], "fast": [3.0, 3.02][:repeats]})
    table = compare(a.path, b.path)
    assert table["verdict"].str.startswith("n/a").all() and table["ci_low"].isna().all()
    assert row(table, "fast", "duration_s")["verdict"] == f"n/a ({repeats} repeat{'s' * (repeats > 1)} on a side, " \
                                                          "an interval needs 3)"


def test_differences_flatten_nested_configs():
    assert differences({"workload": {"output_len": 32, "seed": 0}, "device": "cpu"},
                       {"workload": {"output_len": 64, "seed": 0}, "device": "cpu", "threads": 1}) == [
        ("threads", "-", 1), ("workload.output_len", 32, 64)]


def test_cli_prints_the_differences_and_the_verdicts(tmp_path, capsys):
    a = run_folder(tmp_path, "a", {"slow": [2.0, 2.1, 1.95], "fast": [1.0, 1.02, 0.98]})
    b = run_folder(tmp_path, "b", {"slow": [2.0, 2.1, 1.95], "fast": [2.0, 2.04, 1.96]},
                   env={**ENV, "git_commit": "bbbb"})
    main([str(a.path), str(b.path)])
    out = capsys.readouterr().out
    assert "config (A -> B): the same" in out
    assert "git_commit: 'aaaa' -> 'bbbb'" in out
    assert "beyond noise" in out and "differences beyond noise" in out


def test_runs_that_share_no_grid_point_are_refused(tmp_path):
    a = run_folder(tmp_path, "a", {"slow": [2.0, 2.1, 2.0], "fast": [1.0, 1.1, 1.0]}, output_len=32)
    b = run_folder(tmp_path, "b", {"slow": [2.0, 2.1, 2.0], "fast": [1.0, 1.1, 1.0]}, output_len=64)
    with pytest.raises(SystemExit, match="share no grid point"):
        main([str(a.path), str(b.path)])
