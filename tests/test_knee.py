"""The goodput knee of a rate sweep, on hand-made summaries: found, never met, always met, and an
attainment that recovers above its first miss (the knee stays below the first miss)."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from ablate.analysis.knee import ABOVE, BELOW, UNMEASURED, goodput_knee, report_tables

RATES = [1.0, 2.0, 4.0, 8.0]


def sweep(**attained_by_arm: list[float]) -> pd.DataFrame:
    """A summary: one row per arm and rate with its TTFT-SLO attainment."""
    return pd.DataFrame([{"rate": rate, "arm": arm, "ttft_slo_attained": a}
                         for arm, attained in attained_by_arm.items() for rate, a in zip(RATES, attained)])


def knee_row(table: pd.DataFrame, arm: str) -> pd.Series:
    return table.set_index("arm").loc[arm]


def test_the_knee_is_the_highest_rate_before_the_first_miss():
    table = goodput_knee(sweep(static=[1.0, 0.95, 0.6, 0.2], continuous=[1.0, 1.0, 0.9, 0.4]), target=0.9)
    assert list(table["arm"]) == ["static", "continuous"]
    static, continuous = knee_row(table, "static"), knee_row(table, "continuous")
    assert (static.knee_rate, static.knee_attained, static.missed_rate, static.missed_attained) == (2.0, 0.95, 4.0, 0.6)
    assert static.sweep_missed and not static.met_above_miss and static.knee == "2/s"
    assert (continuous.knee_rate, continuous.missed_rate) == (4.0, 8.0)     # 0.9 meets a target of 0.9


def test_a_sweep_that_never_meets_the_target_has_its_knee_below_it():
    row = knee_row(goodput_knee(sweep(slow=[0.5, 0.3, 0.1, 0.0])), "slow")
    assert math.isnan(row.knee_rate) and math.isnan(row.knee_attained)
    assert (row.missed_rate, row.missed_attained) == (1.0, 0.5) and row.sweep_missed
    assert row.knee == f"{BELOW} (1/s)"


def test_a_sweep_that_always_meets_the_target_does_not_pretend_to_a_knee():
    row = knee_row(goodput_knee(sweep(fast=[1.0, 1.0, 0.98, 0.93])), "fast")
    assert math.isnan(row.knee_rate) and math.isnan(row.missed_rate)
    assert not row.sweep_missed and row.highest_rate_tried == 8.0
    assert row.knee == f"{ABOVE} (8/s)"


def test_a_recovery_above_the_first_miss_does_not_move_the_knee():
    row = knee_row(goodput_knee(sweep(bumpy=[0.95, 0.8, 0.92, 0.5])), "bumpy")
    assert (row.knee_rate, row.missed_rate) == (1.0, 2.0)
    assert row.met_above_miss and row.sweep_missed


def test_rounds_are_reduced_to_their_median_attainment():
    runs = pd.DataFrame({"arm": "a", "rate": [1.0, 1.0, 1.0, 2.0, 2.0, 2.0],
                         "repeat": [0, 1, 2, 0, 1, 2],
                         "ttft_slo_attained": [1.0, 0.5, 0.95, 0.95, 0.2, 0.3]})   # medians 0.95 and 0.3
    row = knee_row(goodput_knee(runs), "a")
    assert (row.knee_rate, row.knee_attained, row.missed_rate, row.missed_attained) == (1.0, 0.95, 2.0, 0.3)


def test_goodput_over_the_rate_stands_in_for_a_missing_attainment():
    summary = pd.DataFrame({"arm": "a", "rate": RATES, "goodput_ttft_req_s": [1.0, 1.9, 3.0, 2.0]})
    row = knee_row(goodput_knee(summary), "a")             # attainments 1.0, 0.95, 0.75, 0.25
    assert (row.knee_rate, row.knee_attained, row.missed_rate) == (2.0, 0.95, 4.0)
    with pytest.raises(ValueError, match=r"neither 'ttft_slo_attained' nor a goodput column .* experiment.ttft_slo_ms"):
        goodput_knee(summary.drop(columns="goodput_ttft_req_s"))


def test_an_arm_without_measurements_is_said_to_have_none():
    summary = sweep(ok=[1.0, 0.5, 0.2, 0.1], failed=[math.nan] * 4)
    row = knee_row(goodput_knee(summary), "failed")
    assert row.knee == UNMEASURED and math.isnan(row.knee_rate)


@pytest.mark.parametrize("target", [0.0, 1.5, math.nan])
def test_a_target_outside_zero_to_one_is_refused(target):
    with pytest.raises(ValueError, match=r"target must be a fraction in \(0, 1\]"):
        goodput_knee(sweep(a=[1.0] * 4), target=target)


@pytest.mark.parametrize("target", [0.0, 1.5, math.nan, True])
def test_knee_target_is_checked_in_the_config(target):
    from ablate.experiment.config import ExperimentConfig

    with pytest.raises(ValueError, match=r"experiment.knee_target must be a fraction in \(0, 1\]"):
        ExperimentConfig(knee_target=target)
    assert ExperimentConfig(knee_target=1.0).knee_target == 1.0


def test_a_rate_sweep_under_a_ttft_slo_reports_its_knee():
    from ablate.book.chapter_tables import analytic_tables, table_name
    from ablate.report.page import markdown

    config = {"experiment": {"chapter": "ch10", "grid": {"rate": RATES}, "ttft_slo_ms": 2000, "knee_target": 0.8}}
    summary = sweep(static=[1.0, 0.85, 0.6, 0.2])
    tables = analytic_tables(config, summary)
    knee = tables["Goodput knee"]
    assert knee_row(knee, "static").knee_rate == 2.0 and set(knee["target"]) == {0.8}
    assert set(knee["ttft_slo_ms"]) == {2000.0}
    assert table_name("Goodput knee") == "analytic_goodput_knee"      # the run folder's CSV
    page = markdown("ch10_batching", summary.assign(label=summary["arm"], unstable=False), ["rate"], [], analytic=tables)
    assert "## Goodput knee" in page and "knee_rate" in page
    # no SLO, no rate grid, or no summary yet: nothing to say
    assert report_tables({"experiment": {"grid": {"rate": RATES}}}, summary) == {}
    assert report_tables({"experiment": {"grid": {"output_len": [8]}, "ttft_slo_ms": 2000}}, summary) == {}
    assert report_tables(config, None) == {}


def test_other_grid_keys_get_a_knee_each():
    summary = pd.concat([sweep(a=[1.0, 0.95, 0.5, 0.1]).assign(output_len=32),
                         sweep(a=[1.0, 0.5, 0.2, 0.1]).assign(output_len=128)])
    config = {"experiment": {"grid": {"rate": RATES, "output_len": [32, 128]}, "ttft_slo_ms": 500}}
    table = report_tables(config, summary)["Goodput knee"]
    assert table.set_index("output_len")["knee_rate"].to_dict() == {32: 2.0, 128: 1.0}
