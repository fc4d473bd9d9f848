"""Chapter 12's analytic tables: the n x n scores in memory (the book's 2 GiB per head at 32k in fp16,
128 GiB per 64-head layer), measured vs analytic rows, and on-chip SRAM against HBM per device."""
from __future__ import annotations

import math
from dataclasses import asdict

import pandas as pd
import pytest

from ablate.analysis.onchip import (ONCHIP, CacheLevel, cache_levels, measure_this_machine, onchip_table,
                                    shared_memory_bandwidth)
from ablate.analysis.score_memory import (book_frame, both_units, measured_naive_peaks, score_bytes,
                                          score_memory_table)
from ablate.book.tables.ch12 import ONCHIP_HEADING, SCORE_MEMORY_HEADING, analytic_tables
from ablate.model.presets import preset

GIB = 2**30


def run_config(grid=(128, 256), device="cpu") -> dict:
    """A ch12-like resolved config: the tiny model, naive / sdpa arms over prompt lengths."""
    return {"model": asdict(preset("tiny", dtype="fp32")), "device": device, "attention": {"name": "naive"},
            "experiment": {"chapter": "ch12", "grid": {"prompt_len": list(grid)},
                           "arms": {"naive": {"attention": "naive"}, "sdpa": {"attention": "sdpa"}}},
            "workload": {"prompt_len": 1024}}


def test_one_head_at_32k_in_fp16_is_2_gib_exactly_and_a_64_head_layer_128_gib():
    assert score_bytes(32768, score_element_bytes=2) == 32768 * 32768 * 2 == 2_147_483_648 == 2 * GIB
    assert score_bytes(32768, n_heads=64, score_element_bytes=2) == 128 * GIB
    assert both_units(2 * GIB) == "2 GiB = 2.147 GB"            # the book's "2 GB" read both ways
    assert both_units(128 * GIB) == "128 GiB = 137.4 GB"
    book = book_frame().set_index("seq_len")
    assert book.loc[32768, "n_heads"] == 64 and book.loc[32768, "head_fp16_bytes"] == 2 * GIB
    assert book.loc[32768, "layer_bytes"] == 128 * GIB and book.loc[32768, "forward_bytes"] == 80 * 128 * GIB
    assert book.loc[32768, "head_fp32_bytes"] == 4 * GIB
    # materialised moves the scores 8 times in fp32 (and the mask once); tiled streams K, V per 128-query tile
    assert book.loc[32768, "materialised_bytes"] > 8 * 4 * 64 * 32768**2
    assert book.loc[32768, "tiled_bytes"] < book.loc[32768, "materialised_bytes"] / 10
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        score_bytes(0)


def test_rows_are_measured_where_the_naive_arm_has_a_peak_and_analytic_elsewhere():
    summary = pd.DataFrame({"prompt_len": [128, 128, 256, 256], "arm": ["naive", "sdpa", "naive", "sdpa"],
                            "status": ["ok", "ok", "failed", "ok"],
                            "peak_memory_bytes": [1_402_240.0, 1_090_944.0, math.nan, 1_680_896.0]})
    assert measured_naive_peaks(run_config(), summary) == {128: 1_402_240.0}     # sdpa's and failed rows left out
    table = score_memory_table(run_config(), summary)
    run = table[table["setting"].str.contains("this run")].set_index("n")
    assert list(run.index) == [128, 256, 16384, 32768, 131072]
    assert run.loc[128, "source"] == "measured" and run.loc[128, "naive peak measured"] == "1.337 MiB = 1.402 MB"
    assert run.loc[256, "source"] == "analytic" and "naive arm has no peak" in run.loc[256, "note"]
    assert run.loc[32768, "source"] == "analytic" and "never measured on a CPU" in run.loc[32768, "note"]
    # tiny has 4 heads: one layer at 32k holds 4 x 32768^2 x 4 bytes (fp32) = 16 GiB; naive's peak twice that
    assert run.loc[32768, "1 layer (all heads)"] == "16 GiB = 17.18 GB"
    assert run.loc[32768, "naive peak: 2 fp32 scores"] == "32 GiB = 34.36 GB"
    book = table[table["setting"].str.startswith("book")].set_index("n")
    assert (book["source"] == "analytic").all() and book.loc[32768, "1 layer (all heads)"] == "128 GiB = 137.4 GB"
    assert book.loc[32768, "1 head fp16"] == "2 GiB = 2.147 GB"
    # no summary yet (or no grid over prompt_len: every row is at workload.prompt_len)
    assert (score_memory_table(run_config(), None)["source"] == "analytic").all()
    no_grid = run_config() | {"experiment": {"arms": {"naive": {}}}}
    assert measured_naive_peaks(no_grid, summary.drop(columns="prompt_len").iloc[[0]]) == {1024: 1_402_240.0}


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="no `model` section"):
        score_memory_table({"experiment": {}}, None)
    with pytest.raises(ValueError, match="prompt lengths must be positive integers"):
        score_memory_table(run_config(grid=(128, -1)), None)


def test_the_device_table_has_the_book_a100_figures_and_derives_the_h100():
    a100 = ONCHIP["a100-80gb"]
    assert (a100.num_sms, a100.sram_per_sm_bytes, a100.max_shared_per_sm_bytes) == (108, 192 * 1024, 164 * 1024)
    assert a100.onchip_bandwidth_bytes_s == 19e12 and 1.5e12 <= a100.hbm_bandwidth_bytes_s <= 2.1e12
    assert shared_memory_bandwidth(108, 1.41e9) == pytest.approx(19e12, rel=0.03)   # the paper's ~19 TB/s
    assert ONCHIP["h100-sxm"].onchip_bandwidth_bytes_s == pytest.approx(132 * 128 * 1.98e9)
    table = onchip_table(None).set_index("device")
    assert list(table.index) == ["A100 80GB SXM", "H100 SXM 80GB", "H200 SXM 141GB"]
    assert table.loc["A100 80GB SXM", "on-chip TB/s"] == 19.0 and table.loc["A100 80GB SXM", "SRAM total MiB"] == 20.25
    assert table.loc["A100 80GB SXM", "on-chip / off-chip"] == pytest.approx(19 / 2.039, abs=0.05)
    assert table.loc["H200 SXM 141GB", "on-chip / off-chip"] == pytest.approx(33.454 / 4.8, abs=0.05)
    assert table["source"].str.len().min() > 20
    with pytest.raises(ValueError, match="unknown devices \\['b200'\\]"):
        onchip_table(None, devices=("b200",))


def test_cache_sizes_are_read_from_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                             (3, "Unified", "32M")]):
        folder = tmp_path / f"index{i}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    assert cache_levels(tmp_path) == [CacheLevel(1, "Data", 32 * 1024), CacheLevel(2, "Unified", 2**20),
                                      CacheLevel(3, "Unified", 32 * 2**20)]
    assert cache_levels(tmp_path / "none") == []


def test_this_machine_is_measured_and_its_cache_is_not_slower_than_its_dram():
    levels = [CacheLevel(2, "Unified", 2**20), CacheLevel(3, "Unified", 8 * 2**20)]
    measured = measure_this_machine(levels, budget_s=0.05)      # 512 KiB against 256 MiB
    assert measured.cache_working_set == 512 * 1024 and measured.memory_working_set == 256 * 2**20
    assert measured.cache_bytes_s > 0 and measured.memory_bytes_s > 0
    assert measured.cache_bytes_s >= 0.5 * measured.memory_bytes_s   # timing on a shared machine: sanity only
    row = onchip_table(measured, levels).iloc[-1]
    assert row["device"].startswith("this machine") and row["L2 / LLC MiB"] == 8
    assert row["on-chip / off-chip"] == pytest.approx(measured.ratio, abs=0.05)


@pytest.mark.slow      # measures this machine at the chapter's budget (~2 s); the measurement and tables: tests above
def test_chapter_12_gets_both_tables():
    summary = pd.DataFrame({"prompt_len": [128], "arm": ["naive"], "status": ["ok"], "peak_memory_bytes": [2e6]})
    tables = analytic_tables(run_config(), summary)
    assert list(tables) == [SCORE_MEMORY_HEADING, ONCHIP_HEADING]
    assert (tables[SCORE_MEMORY_HEADING]["source"] == "measured").sum() == 1
    assert tables[ONCHIP_HEADING]["device"].iloc[-1].startswith("this machine")
