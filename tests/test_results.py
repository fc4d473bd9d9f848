"""Results: a job run end to end (Hydra compose -> run_job), the stored tables, re-runs, W&B
offline, the metric definitions on a hand-made recorder, bootstrap CIs and failed jobs."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ablate.experiment.job import run_identity, run_job
from ablate.measure.metrics import goodput, kv_utilisation, request_table, summarise, ttft_slo_attainment
from ablate.measure.recorder import Recorder, RequestRecord, StepRecord
from ablate.analysis.stats import log_interval
from ablate.results import config_hash, load, runs_under

SMALL = ["experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2", "workload.prompt_len=8",
         "workload.output_len=4"]
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4          # tiny, fp32


def run_folders(experiment_dir: Path) -> list[Path]:
    """The run folders of an experiment (beside them: each one's lock file, `.<id>.lock`)."""
    return sorted(p for p in experiment_dir.iterdir() if p.is_dir())

RUNS_COLUMNS = {"arm", "label", "repeat", "duration_s", "output_tokens", "output_throughput_tok_s", "ttft_p50_ms",
                "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "itl_p50_ms", "kv_reserved_peak_bytes",
                "kv_used_peak_bytes", "peak_memory_bytes", "weight_bytes", "kv_bytes_per_token",
                "predicted_step_time_s_total", "attention_backend", "steps"}
REQUEST_COLUMNS = {"request_id", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s", "itl_mean_s",
                   "finish_reason", "arm", "repeat"}
SUMMARY_COLUMNS = {"arm", "label", "speedup", "speedup_ci_low", "speedup_ci_high", "predicted_speedup",
                   "duration_s", "output_throughput_tok_s", "peak_memory_bytes", "memory_ratio", "duration_cv"}


@pytest.fixture(scope="module")
def offline_job(compose_config, registry, tmp_path_factory):
    """Baseline vs kv_cache=contiguous, 3 repeats, logged to W&B offline under a temporary folder."""
    tmp = tmp_path_factory.mktemp("job")
    raw = compose_config(tmp, "kv_cache=contiguous", "wandb.mode=offline", *SMALL)
    folder = run_job(raw, registry)
    return raw, folder, tmp


@pytest.mark.slow   # the shared job, logged to W&B offline, takes several seconds
def test_composed_config_is_what_the_cli_hands_over(offline_job):
    raw, folder, tmp = offline_job
    assert raw["kv_cache"]["name"] == "contiguous" and raw["kv_cache"]["budget_bytes"] == 0
    assert raw["model"]["name"] == "tiny" and raw["results_dir"] == str(tmp / "results")
    assert folder.path.parent == tmp / "results" / "default"
    # model.dtype=auto (the root config's default) is recorded as what it resolved to on this device
    assert raw["model"]["dtype"] == "auto"
    assert json.loads((folder.path / "config.json").read_text()) == {**raw, "model": {**raw["model"], "dtype": "fp32"}}
    env = json.loads((folder.path / "environment.json").read_text())
    assert env["device"] == "cpu" and env["versions"]["torch"] and env["device_identity"] == "cpu"
    assert set(env["tf32"]) == {"cuda_matmul_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision"}
    assert env["free_memory_bytes_at_start"] > 0
    # run in-process, not from the CLI's start (ablate/process_env.py): the test process's own, recorded
    assert env["huge_pages"]["thp_mem_alloc_enable"] == (env["process_env"]["THP_MEM_ALLOC_ENABLE"] or "")
    assert set(env["huge_pages"]) == {"policy", "thp_mem_alloc_enable", "process_bytes_on_huge_pages"}
    runs = load(folder.path).runs
    assert set(runs["dtype"]) == {"fp32"}


@pytest.mark.slow   # the shared job, logged to W&B offline, takes several seconds
def test_results_load_returns_the_documented_tables(offline_job):
    _, folder, _ = offline_job
    res = load(folder.path)
    assert runs_under(folder.path.parent.parent) == [folder.path]
    assert RUNS_COLUMNS <= set(res.runs.columns)
    assert REQUEST_COLUMNS <= set(res.requests.columns)
    assert SUMMARY_COLUMNS <= set(res.summary.columns)

    runs = res.runs
    assert sorted(zip(runs["arm"], runs["repeat"])) == [(arm, r) for arm in ("baseline", "kv_cache=contiguous")
                                                        for r in range(3)]
    assert (runs["output_tokens"] == 8).all() and (runs["duration_s"] > 0).all()
    np.testing.assert_allclose(runs["output_throughput_tok_s"], 8 / runs["duration_s"])
    reserved = runs.groupby("arm")["kv_reserved_peak_bytes"].unique()
    assert list(reserved["baseline"]) == [0]
    assert list(reserved["kv_cache=contiguous"]) == [8 * 12 * KV_BYTES_PER_TOKEN]   # 8 slots x (8 + 4) tokens
    np.testing.assert_array_equal(runs["peak_memory_bytes"],
                                  runs["weight_bytes"] + runs["weight_copy_bytes"] + runs["kv_reserved_peak_bytes"])
    assert (runs["steps"] == 4).all()

    req = res.requests
    assert len(req) == 12 and (req["output_tokens"] == 4).all() and (req["prompt_tokens"] == 8).all()
    assert (req["ttft_s"] > 0).all() and (req["e2e_s"] > req["ttft_s"]).all()
    np.testing.assert_allclose(req["tpot_s"], (req["e2e_s"] - req["ttft_s"]) / 3)
    # each run's percentiles are its requests' (two requests: p50 is their mean)
    for (arm, repeat), group in req.groupby(["arm", "repeat"]):
        row = runs[(runs["arm"] == arm) & (runs["repeat"] == repeat)].iloc[0]
        assert row["ttft_p50_ms"] == pytest.approx(group["ttft_s"].median() * 1e3)
        assert row["tpot_p50_ms"] == pytest.approx(group["tpot_s"].median() * 1e3)
        assert row["duration_s"] == pytest.approx(group["finish_s"].max())

    summary = res.summary.set_index("arm")
    base = summary.loc["baseline"]
    assert (base["speedup"], base["speedup_ci_low"], base["speedup_ci_high"], base["predicted_speedup"]) == (1, 1, 1, 1)
    arm = summary.loc["kv_cache=contiguous"]
    durations = runs.pivot(index="repeat", columns="arm", values="duration_s")
    ratios = durations["baseline"] / durations["kv_cache=contiguous"]
    assert arm["speedup"] == pytest.approx(np.exp(np.log(ratios).mean()))     # geometric mean over rounds
    interval = log_interval(ratios.to_numpy())                                 # t on the log ratios
    assert (arm["speedup_ci_low"], arm["speedup_ci_high"]) == pytest.approx((interval.low, interval.high))
    assert arm["speedup_ci_low"] <= arm["speedup"] <= arm["speedup_ci_high"] and arm["speedup_rounds"] == 3
    predicted = runs.groupby("arm")["predicted_step_time_s_total"].median()
    assert arm["predicted_speedup"] == pytest.approx(predicted["baseline"] / predicted["kv_cache=contiguous"])
    assert arm["memory_ratio"] > 1                     # the cache costs memory the recompute does not hold
    report = (folder.path / "report.md").read_text()
    assert "kv_cache=contiguous" in report and "speedup" in report


@pytest.mark.slow   # runs jobs end to end (report figures included): several seconds
def test_same_config_is_skipped_unless_redo(compose_config, registry, tmp_path, capsys):
    raw = compose_config(tmp_path, "wandb.mode=disabled", *SMALL, "experiment.repeats=1")
    first = run_job(raw, registry)
    done = (first.path / "done.json").read_text()
    capsys.readouterr()
    again = run_job(raw, registry)
    assert "already finished" in capsys.readouterr().out
    assert again.path == first.path and (first.path / "done.json").read_text() == done
    assert run_folders(first.path.parent) == [first.path]
    # W&B settings do not change what is measured: still the same run
    assert run_job({**raw, "wandb": {**raw["wandb"], "project": "other"}}, registry).path == first.path
    assert "already finished" in capsys.readouterr().out
    # a measured field is another run (its id is the hash of the measured config and the device)
    cpu = torch.device("cpu")
    assert config_hash(run_identity(raw, cpu)) == first.path.name
    other = {**raw, "workload": {**raw["workload"], "seed": 1}}
    assert config_hash(run_identity(other, cpu)) != first.path.name

    redone = run_job({**raw, "redo": True}, registry)
    out = capsys.readouterr().out
    assert "already finished" not in out and "round 1" in out
    assert redone.path == first.path and (redone.path / "done.json").exists()
    moved = [p for p in run_folders(first.path.parent) if p.name.startswith(first.path.name + ".old-")]
    assert len(moved) == 1 and (moved[0] / "done.json").read_text() == done       # the old run kept aside


# -- W&B offline ------------------------------------------------------------------------------------------

def wandb_records(path: Path):
    """The records of a .wandb file (W&B's LevelDB-style log of protobuf Records).

    wandb 0.31 writes no files/wandb-summary.json for an offline run and no longer ships a
    Python reader, so this follows the format: a 7-byte header (':W&B', magic, version), then
    32 KiB blocks of chunks, each a 7-byte header (CRC32, length, type: 1 full, 2 first,
    3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:                      # zero padding to the end of the block
            pos += left - 7
            continue
        chunk, pos = data[pos:pos + length], pos + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


@pytest.mark.slow
def test_offline_wandb_run_holds_the_logged_speedup(offline_job):
    raw, folder, tmp = offline_job
    done = json.loads((folder.path / "done.json").read_text())
    run_dir = Path(done["wandb_dir"])
    assert run_dir.is_relative_to(tmp / "wandb") and run_dir.name.startswith("offline-run-")
    (log,) = run_dir.glob("run-*.wandb")
    summary, runs = {}, []
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            summary |= {item.key: json.loads(item.value_json) for item in record.summary.update if item.key}
        elif kind == "run":
            runs.append(record.run)
    expected = load(folder.path).summary.set_index("arm")
    assert summary["speedup/baseline"] == 1.0
    assert summary["speedup/kv_cache=contiguous"] == pytest.approx(expected.loc["kv_cache=contiguous", "speedup"])
    assert summary["speedup_ci_low/kv_cache=contiguous"] == pytest.approx(
        expected.loc["kv_cache=contiguous", "speedup_ci_low"])
    assert summary["kv_reserved_peak_bytes/kv_cache=contiguous"] == 8 * 12 * KV_BYTES_PER_TOKEN
    (run,) = runs
    assert run.run_group == "default" and run.project == "ablate"
    assert run.display_name == f"default-{folder.path.name}"
    assert {"tiny", "kv_cache=contiguous"} <= set(run.tags)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["kv_cache"] == raw["kv_cache"] and config["workload"]["output_len"] == 4


# -- metric definitions on a hand-made recorder -------------------------------------------------------------

def hand_made_recorder() -> Recorder:
    rec = Recorder(kv_cache=None)
    rec.requests = {
        # arrives at 10 s; tokens at 10.5, 10.75 and two at once at 11.25 (e.g. speculative)
        0: RequestRecord(0, 10.0, 5, [(10.5, 1), (10.75, 1), (11.25, 2)], finish=11.25, finish_reason="length"),
        # arrives at 10.25; one token at 10.5
        1: RequestRecord(1, 10.25, 3, [(10.5, 1)], finish=10.5, finish_reason="stop"),
    }
    rec.steps = [
        StepRecord(10.0, 10.5, 2, 8, 2, kv_bytes_reserved=100, kv_bytes_used=50),
        StepRecord(10.5, 10.75, 1, 1, 0, kv_bytes_reserved=200, kv_bytes_used=150),
        StepRecord(10.75, 11.25, 1, 1, 0, kv_bytes_reserved=200, kv_bytes_used=100),
    ]
    return rec


def test_request_metrics_follow_their_definitions():
    table = request_table(hand_made_recorder()).set_index("request_id")
    r0, r1 = table.loc[0], table.loc[1]
    assert r0["ttft_s"] == 0.5 and r0["e2e_s"] == 1.25 and r0["output_tokens"] == 4
    assert r0["tpot_s"] == pytest.approx((1.25 - 0.5) / 3)           # (E2E - TTFT) / (n - 1)
    assert r0["itl_mean_s"] == pytest.approx((0.25 + 0.5) / 2)       # a 2-token emission is one gap
    assert r0["num_emissions"] == 3 and r0["tokens_per_emission"] == pytest.approx(4 / 3)
    assert r0["arrival_s"] == 0.0 and r0["finish_s"] == 1.25
    assert r1["ttft_s"] == 0.25 and r1["e2e_s"] == 0.25 and np.isnan(r1["tpot_s"]) and np.isnan(r1["itl_mean_s"])
    assert r1["arrival_s"] == 0.25 and r1["finish_reason"] == "stop"


def test_run_metrics_follow_their_definitions():
    s = summarise(hand_made_recorder())
    assert s["duration_s"] == 1.25                                    # last finish - first arrival
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 8
    assert s["output_throughput_tok_s"] == pytest.approx(5 / 1.25)
    assert s["total_throughput_tok_s"] == pytest.approx(13 / 1.25)
    assert s["request_throughput_req_s"] == pytest.approx(2 / 1.25)
    assert s["ttft_p50_ms"] == pytest.approx(375.0) and s["ttft_mean_ms"] == pytest.approx(375.0)
    assert s["tpot_p50_ms"] == pytest.approx(250.0)                 # request 1 has no TPOT
    assert s["e2e_p50_ms"] == pytest.approx(750.0)
    assert s["itl_p50_ms"] == pytest.approx(375.0) and s["itl_p99_ms"] == pytest.approx(497.5)
    assert s["tokens_per_emission"] == pytest.approx(5 / 4)
    assert s["steps"] == 3 and s["batch_size_max"] == 2 and s["batch_size_mean"] == pytest.approx(4 / 3)
    assert s["kv_reserved_peak_bytes"] == 200 and s["kv_used_peak_bytes"] == 150
    # time-weighted used/reserved: (0.5 x 0.5 + 0.25 x 0.75 + 0.5 x 0.5) / 1.25
    assert s["kv_util_mean"] == pytest.approx((0.25 + 0.1875 + 0.25) / 1.25)
    assert s["kv_util_at_peak"] == pytest.approx(0.75)              # the first step of peak reservation
    assert np.isnan(s["decode_step_q1_ms"])                          # fewer than 4 decode steps


def test_kv_utilisation_without_a_cache_is_undefined():
    rec = hand_made_recorder()
    rec.steps = [StepRecord(0.0, 1.0, 1, 4, 1, 0, 0)]
    util = kv_utilisation(rec)
    assert np.isnan(util["kv_util_mean"]) and np.isnan(util["kv_util_at_peak"])


def test_goodput_counts_requests_meeting_every_slo():
    table = request_table(hand_made_recorder())
    assert goodput(table, None, None, 2.0) == 1.0
    assert goodput(table, 400, None, 2.0) == 0.5                     # only request 1's TTFT is <= 400 ms
    assert goodput(table, 600, 200, 1.0) == 1.0                      # request 0's TPOT 250 ms misses
    assert goodput(table, 600, 300, 1.0) == 2.0                      # a 1-token request has no TPOT to miss


def test_ttft_goodput_counts_the_ttft_slo_alone():
    table = request_table(hand_made_recorder())                      # TTFT 500 ms and 250 ms; TPOT 250 ms and none
    # a TTFT SLO of 600 ms and a TPOT SLO of 200 ms: request 0 meets the TTFT SLO but misses the TPOT one
    assert goodput(table, 600, 200, 2.0) == 0.5
    assert ttft_slo_attainment(table, 600, 2.0) == {"goodput_ttft_req_s": 1.0, "ttft_slo_attained": 1.0}
    assert ttft_slo_attainment(table, 400, 2.0) == {"goodput_ttft_req_s": 0.5, "ttft_slo_attained": 0.5}
    never = pd.concat([table, pd.DataFrame({"ttft_s": [np.nan]})], ignore_index=True)   # never emitted: misses it
    assert ttft_slo_attainment(never, 600, 1.0) == {"goodput_ttft_req_s": 2.0, "ttft_slo_attained": 2 / 3}
    with pytest.raises(ValueError, match="must be positive"):
        ttft_slo_attainment(table, 0, 2.0)


# -- failures ---------------------------------------------------------------------------------------------

@pytest.mark.slow   # runs jobs end to end (report figures included): several seconds
def test_a_failing_job_in_a_sweep_is_recorded_and_keeps_earlier_results(compose_config, registry, tmp_path, capsys):
    good = run_job(compose_config(tmp_path, "wandb.mode=disabled", *SMALL, "experiment.repeats=1"), registry)
    good_runs = (good.path / "runs.csv").read_text()
    # the workload needs 8 + 64 tokens per sequence; the model covers 16
    failing = compose_config(tmp_path, "wandb.mode=disabled", *SMALL, "experiment.repeats=1",
                             "workload.output_len=64", "model.max_seq_len=16")
    assert run_job(failing, registry, swallow_errors=True) is None
    assert "job failed" in capsys.readouterr().out
    (failed,) = [p for p in run_folders(good.path.parent) if p != good.path]
    record = json.loads((failed / "failed.json").read_text())
    assert record["status"] == "failed"
    assert record["error"].startswith(
        "ValueError: workload.prompt_len and workload.output_len ask for up to 72 tokens per sequence but model.max_seq_len is 16")
    assert "Traceback" in record["traceback"]
    assert not (failed / "done.json").exists() and not (failed / "runs.csv").exists()
    # the earlier job is untouched and still the only finished one
    assert (good.path / "runs.csv").read_text() == good_runs
    assert runs_under(tmp_path / "results") == [good.path]
    assert len(load(good.path).runs) == 1
    # outside a sweep the error propagates
    with pytest.raises(ValueError, match="model.max_seq_len is 16"):
        run_job(failing, registry)


def test_load_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an ablate run folder"):
        load(tmp_path)


def test_results_set_aside_twice_in_one_second_stay_side_by_side(tmp_path, monkeypatch):
    """The second set-aside of a run within the same second must not be moved inside the first."""
    import time as time_mod

    from ablate.results import RunFolder

    monkeypatch.setattr(time_mod, "strftime", lambda fmt, *a: "20261202-000000")
    asides = []
    for i in range(3):
        folder = RunFolder(tmp_path / "abc")
        folder.path.mkdir()
        (folder.path / "runs.csv").write_text(f"round {i}\n")
        asides.append(folder.set_aside("test"))
    assert len(set(asides)) == 3 and all(a.parent == tmp_path for a in asides)
    assert sorted((a / "runs.csv").read_text() for a in asides) == ["round 0\n", "round 1\n", "round 2\n"]
