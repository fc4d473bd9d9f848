"""Decoding without a KV cache (ch07, ch08): positions and FLOPs recomputed, and chapter 8's table (ablate.book.tables.ch08)."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from ablate.analysis.analytic import CostModel
from ablate.analysis.recompute import (attention_crossover_len, attention_pairs_with_cache,
                                       attention_pairs_without_cache, doubling_ratio, flops_with_cache,
                                       flops_without_cache, length_ratio, positions_with_cache,
                                       positions_without_cache, recomputed_positions)
from ablate.book.tables.ch08 import TABLE_HEADING, analytic_tables
from ablate.model.presets import preset


def test_the_books_counts():
    assert recomputed_positions(1000) == sum(range(1, 1000)) == 499_500      # 1 + 2 + ... + 999
    assert positions_without_cache(1000) == 500_500 and positions_with_cache(1000) == 1000
    assert round(length_ratio(4096, 1000), 1) == 16.8                        # the book rounds it to 16
    assert length_ratio(4096, 1000) == 4096 * 4097 / (1000 * 1001)
    for n in (1, 10, 1000):
        assert doubling_ratio(n) == pytest.approx(4 - 2 / (n + 1))
    assert doubling_ratio(10**6) == pytest.approx(4, abs=1e-5)


@pytest.mark.parametrize(("n", "p"), [(1, 1), (1, 7), (2, 1), (9, 1), (16, 128), (33, 5)])
def test_closed_forms_match_the_passes_summed(n, p):
    lengths = [p + k - 1 for k in range(1, n + 1)]       # pass k feeds S_k = p + k - 1 positions
    assert positions_without_cache(n, p) == sum(lengths)
    assert positions_with_cache(n, p) == p + len(lengths[1:])
    assert attention_pairs_without_cache(n, p) == sum(s * (s + 1) // 2 for s in lengths)
    assert attention_pairs_with_cache(n, p) == p * (p + 1) // 2 + sum(lengths[1:])
    cfg = preset("tiny")                                 # the engine's per-step cost model, summed
    keep, drop = CostModel(cfg, keeps_kv=True), CostModel(cfg, keeps_kv=False)
    assert flops_without_cache(cfg, n, p).total == pytest.approx(sum(drop.step([s], [s], 1).flops for s in lengths))
    cached = keep.step([p], [p], 1).flops + sum(keep.step([1], [s], 1).flops for s in lengths[1:])
    assert flops_with_cache(cfg, n, p).total == pytest.approx(cached)


def test_attention_is_cubic_without_a_cache_and_overtakes_the_projections():
    cfg = preset("llama-2-7b")
    n = 4096
    none, none2 = flops_without_cache(cfg, n), flops_without_cache(cfg, 2 * n)
    cached, cached2 = flops_with_cache(cfg, n), flops_with_cache(cfg, 2 * n)
    assert none2.attention / none.attention == pytest.approx(8, rel=1e-3)      # cubic
    assert none2.projection / none.projection == pytest.approx(4, rel=1e-3)    # quadratic
    assert cached2.attention / cached.attention == pytest.approx(4, rel=1e-3)
    assert cached2.projection / cached.projection == pytest.approx(2, rel=1e-3)
    crossover = attention_crossover_len(cfg)
    assert 70_000 < crossover < 78_000                                         # the docstring's ~74,000
    below, above = flops_without_cache(cfg, int(crossover / 2)), flops_without_cache(cfg, int(crossover * 2))
    assert below.projection > below.attention and above.attention > above.projection


def test_bad_lengths_are_refused():
    for n, p in ((0, 1), (10, 0), (2.5, 1)):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            positions_without_cache(n, p)


def _config(grid: dict, workload: dict | None = None) -> dict:
    model = vars(preset("tiny")).copy()
    return {"model": model, "workload": {"prompt_len": 128, "output_len": 128, **(workload or {})},
            "experiment": {"chapter": "ch08", "grid": grid, "arms": {"recompute": {"kv_cache": "none"},
                                                                    "contiguous": {"kv_cache": "contiguous"},
                                                                    "dynamic": {"kv_cache": "dynamic"}}}}


def test_chapter_tables_put_predictions_beside_a_summary():
    summary = pd.DataFrame([
        {"output_len": 16, "arm": "recompute", "status": "ok", "duration_s": 0.8, "tpot_p50_ms": 14.0},
        {"output_len": 16, "arm": "contiguous", "status": "ok", "duration_s": 0.1, "tpot_p50_ms": 4.0},
        {"output_len": 16, "arm": "dynamic", "status": "ok", "duration_s": 0.2, "tpot_p50_ms": 9.0},
        {"output_len": 32, "arm": "recompute", "status": "ok", "duration_s": 2.4, "tpot_p50_ms": 70.0},
        {"output_len": 32, "arm": "contiguous", "status": "failed", "duration_s": 0.2, "tpot_p50_ms": 5.0}])
    table = analytic_tables(_config({"output_len": [16, 32]}), summary)[TABLE_HEADING]
    cfg = preset("tiny")
    assert list(table["output"]) == [16, 32] and list(table["prompt"]) == [128, 128]
    assert list(table["positions no cache"]) == [16 * 128 + 16 * 15 // 2, 32 * 128 + 32 * 31 // 2]
    assert list(table["positions cached"]) == [143, 159]
    predicted = flops_without_cache(cfg, 16, 128).total / flops_with_cache(cfg, 16, 128).total
    assert table["FLOPs ratio (pred)"].iloc[0] == round(predicted, 2)
    assert table["time ratio (meas)"].iloc[0] == 8.0 and table["TPOT ratio (meas)"].iloc[0] == 3.5
    assert math.isnan(table["time ratio (meas)"].iloc[1])                 # the cached arm failed there
    growth = flops_without_cache(cfg, 32, 128).total / flops_without_cache(cfg, 16, 128).total
    assert math.isnan(table["no-cache growth (pred)"].iloc[0])
    assert table["no-cache growth (pred)"].iloc[1] == round(growth, 2) and table["no-cache growth (meas)"].iloc[1] == 3.0
    alone = analytic_tables(_config({"output_len": [16, 32]}), None)[TABLE_HEADING]
    assert alone["time ratio (meas)"].isna().all() and list(alone["FLOPs ratio (pred)"]) == list(table["FLOPs ratio (pred)"])


def test_chapter_tables_follow_any_grid():
    config = _config({"prompt_len": [8, 64], "output_len": [4, 8, 16]})
    table = analytic_tables(config, None)[TABLE_HEADING]
    assert list(zip(table["prompt"], table["output"])) == [(8, 4), (8, 8), (8, 16), (64, 4), (64, 8), (64, 16)]
    assert table["no-cache growth (pred)"].isna().tolist() == [True, False, False, True, False, False]
    cfg = preset("tiny")
    assert table["no-cache growth (pred)"].iloc[4] == round(
        flops_without_cache(cfg, 8, 64).total / flops_without_cache(cfg, 4, 64).total, 2)
    plain = analytic_tables(_config({}, {"prompt_len": 32, "output_len": 10}), None)[TABLE_HEADING]
    assert len(plain) == 1 and plain["positions no cache"].iloc[0] == positions_without_cache(10, 32)
    assert "no-cache growth (pred)" not in plain


def test_chapter_8_reports_ask_for_the_table():
    from ablate.book.chapter_tables import analytic_tables as for_the_run
    assert list(for_the_run(_config({"output_len": [16]}), None)) == [TABLE_HEADING]
