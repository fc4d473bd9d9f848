"""What a job prints: the compact summary table within 100 columns, and the job prefix of a sweep."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ablate.report.console import job_prefix
from ablate.report.console_table import CONSOLE_WIDTH, console_table
from ablate.report.tables import summary_table

ARMS = ["recompute", "kv_cache=contiguous,attention=sdpa,scheduler=fcfs",
        "kv_cache=paged,block_size=16,attention=flash_decoding,scheduler=fcfs",
        "kv_cache=paged,block_size=16,attention=flash_decoding,scheduler=priority",
        "kv_cache=quantised_int8,attention=sdpa", "decoding=speculative_ngram_k4_with_a_long_drafter_name"]


def realistic_summary(**extra) -> pd.DataFrame:
    rows = []
    for output_len in (64, 1024):
        for i, arm in enumerate(ARMS):
            rows.append({"output_len": output_len, "arm": arm, "label": arm, "status": "ok", "status_detail": "",
                         "speedup": 1.0 if i == 0 else 1.87 * i, "speedup_ci_low": 1.0 if i == 0 else 1.80 * i,
                         "speedup_ci_high": 1.0 if i == 0 else 1.95 * i, "output_throughput_tok_s": 12345.678 * i,
                         "ttft_p50_ms": 20.0, "ttft_p99_ms": 1234.5 + i, "tpot_p50_ms": 5.0, "tpot_p99_ms": 45.67,
                         "peak_memory_bytes": 512 * 2**20 * (i + 1), "kv_reserved_peak_bytes": 2**28,
                         "ppl_ratio": 1.0 + 0.01 * i, "token_agreement": 1.0 - 0.02 * i,
                         "quality_flag": "ok" if i < 4 else "degraded", **extra})
    frame = pd.DataFrame(rows)
    frame.loc[5, ["status", "status_detail", "speedup", "speedup_ci_low", "speedup_ci_high"]] = \
        ["failed", "CUDA out of memory while allocating a very long buffer " * 3, np.nan, np.nan, np.nan]
    frame.loc[4, ["speedup_ci_low", "speedup_ci_high"]] = [np.nan, np.nan]   # 2 rounds: no interval
    return frame


def test_the_console_table_fits_100_columns_and_keeps_arms_apart():
    summary = realistic_summary()
    text = console_table(summary, ["output_len"])
    lines = text.splitlines()
    assert all(len(line) <= CONSOLE_WIDTH for line in lines), "\n".join(lines)
    header = lines[0]
    for column in ("output_len", "arm", "status", "speedup [95% CI]", "TTFT99", "peak mem", "ppl", "agree"):
        assert column in header
    body = lines[1:1 + len(summary)]
    names = [line.split()[1] for line in body[:len(ARMS)]]
    assert len(set(names)) == len(ARMS)        # cut names stay distinct
    assert names[0] == "recompute"
    assert "3.74x [3.60, 3.90]" in body[2] and "512 MiB" in body[0] and "1.50 GiB" in body[2]
    assert "7.48x [n/a]" in body[4]            # too few rounds for an interval
    assert "n/a" in body[5] and "failed" in body[5]
    footer = lines[len(summary) + 1:]
    assert any("FAILED: CUDA out of memory" in line for line in footer)
    assert any(line.endswith("= decoding=speculative_ngram_k4_with_a_long_drafter_name") for line in footer)
    assert "tok/s" not in header      # the column that gives way first
    # wider than 100 as a full table; the report keeps that one
    assert max(map(len, summary_table(summary, ["output_len"]).to_string(index=False).splitlines())) > CONSOLE_WIDTH


def test_the_console_table_without_quality_or_grid():
    summary = realistic_summary().drop(columns=["ppl_ratio", "token_agreement", "quality_flag"])
    summary = summary[summary["output_len"] == 64].drop(columns="output_len").iloc[:2]
    lines = console_table(summary, []).splitlines()
    assert lines[0].split()[:2] == ["arm", "speedup"] and "agree" not in lines[0] and "ppl" not in lines[0]
    assert lines[2].startswith("kv_cache=contiguous,at..on=sdpa,scheduler=fcfs  1.87x")   # cut only as needed
    assert all(len(line) <= CONSOLE_WIDTH for line in lines)


def test_job_prefix_outside_hydra_is_empty():
    assert job_prefix() == ""


def test_job_prefix_in_a_multirun():
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    def set_hydra(mode: RunMode, num: int) -> None:
        hydra = OmegaConf.structured(HydraConf)
        hydra.mode, hydra.job.num = mode, num
        HydraConfig.instance().set_config(OmegaConf.create({"hydra": hydra}))

    try:
        set_hydra(RunMode.MULTIRUN, 3)
        assert job_prefix() == "[job 3] "
        set_hydra(RunMode.RUN, 0)
        assert job_prefix() == ""
    finally:
        HydraConfig.instance().cfg = None
    assert job_prefix() == ""


def test_a_warning_is_one_line_kept_by_every_open_block(capsys):
    from ablate.report.console import kept_warnings, show_warning, warning

    with kept_warnings() as outer:
        warning("first\n  over   two lines")
        with kept_warnings() as inner:
            show_warning(UserWarning("second"), UserWarning, "somewhere.py", 12)
    warning("after")
    assert outer == ["first over two lines", "second"] and inner == ["second"]
    assert capsys.readouterr().err.splitlines() == ["WARNING: first over two lines", "WARNING: second",
                                                    "WARNING: after"]


@pytest.mark.slow    # a run of the CLI
def test_a_runs_warnings_are_one_line_each_and_recorded(tmp_path):
    import json

    from test_cli_errors import ablate

    # attention=flash on a CPU, outside Triton's interpreter (which other tests turn on for this process),
    # warns that it runs PyTorch's SDPA instead; a noisy arm gets a note
    done = ablate(tmp_path, "attention=flash", "experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2",
                  "workload.prompt_len=8", "workload.output_len=4", "device=cpu", "threads=1", "peak_bandwidth=1e10",
                  "peak_flops=1e11", ABLATE_MIN_CPU_SHARE="1", TRITON_INTERPRET="0")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "flash" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING: attention=flash: no Triton"), done.stderr
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr
    folder = next((tmp_path / "results" / "default").glob("*/done.json")).parent
    recorded = json.loads((folder / "done.json").read_text())["warnings"]
    assert any(w.startswith("attention=flash: no Triton") for w in recorded)
    assert any("NOISY: other work took the CPU" in w for w in recorded)      # a share of 1 is never left
    report = (folder / "report.md").read_text()
    assert "warning: attention=flash: no Triton" in report and "NOISY: other work took the CPU" in report
