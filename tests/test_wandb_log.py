"""W&B logging: figures logged as images by name, and every way W&B can fail ending in one warning
line and (for online) an offline run, never in an error of the benchmark."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from ablate.experiment.job import run_job
from ablate.report.wandb_log import WandbConfig, log_run

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SMALL = ["experiment.repeats=2", "experiment.warmup=0", "workload.num_requests=2", "workload.prompt_len=8",
         "workload.output_len=4"]


def closed_port() -> int:
    """A local port nothing listens on: bound once by us, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def unreachable_wandb(monkeypatch, tmp_path):
    """W&B pointed at a closed local port, with no API key anywhere (env, .netrc, settings file)."""
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    yield
    wandb.teardown()     # wandb keeps the key and server it logged in with for the process: forget them


def figure(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2], [1, 2])
    fig.savefig(path)
    plt.close(fig)
    return path


def log(settings: WandbConfig, tmp_path: Path, images: dict[str, Path] | None = None) -> str | None:
    return log_run(settings, name="test-run", group="test", tags=["ch08", "kv_cache=contiguous"],
                   config={"model": {"name": "tiny"}}, summary={"speedup/contiguous": 2.0},
                   tables={"summary": pd.DataFrame({"arm": ["a", "b"], "speedup": [1.0, 2.0]})},
                   images=images or {}, default_dir=tmp_path)


def warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("WARNING:")]


def test_each_figure_is_logged_as_an_image_under_its_name(tmp_path):
    images = {name: figure(tmp_path / f"{name}.png") for name in ("speedup", "latency")}
    run_dir = Path(log(WandbConfig(mode="offline", dir=str(tmp_path / "wandb")), tmp_path, images))
    assert run_dir.name.startswith("offline-run-")
    logged = sorted(p.name.split("_")[0] for p in (run_dir / "files" / "media" / "images").glob("*.png"))
    assert logged == ["latency", "speedup"]


def test_online_without_an_api_key_logs_offline_with_one_warning_line(unreachable_wandb, tmp_path, capfd):
    start = time.perf_counter()
    run_dir = log(WandbConfig(mode="online", dir=str(tmp_path / "wandb"), init_timeout=5), tmp_path)
    assert time.perf_counter() - start < 20
    assert run_dir is not None and Path(run_dir).name.startswith("offline-run-")
    assert list(Path(run_dir).glob("run-*.wandb"))              # the offline run holds the logged data
    (line,) = warning_lines(capfd.readouterr().err)
    assert "W&B online logging failed" in line and "logged offline instead" in line and "wandb sync" in line


@pytest.mark.slow      # wandb tries the server for seconds; the same fallback without a key: the test above
def test_online_with_an_unreachable_server_logs_offline(unreachable_wandb, monkeypatch, tmp_path, capfd):
    # a key of the right shape: the server is the problem; wandb tries it for a few seconds
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    start = time.perf_counter()
    run_dir = log(WandbConfig(mode="online", dir=str(tmp_path / "wandb"), init_timeout=3), tmp_path)
    assert time.perf_counter() - start < 60
    assert run_dir is not None and Path(run_dir).name.startswith("offline-run-")
    (line,) = warning_lines(capfd.readouterr().err)
    assert "W&B online logging failed" in line and "logged offline instead" in line


def test_without_wandb_installed_the_run_goes_on_with_one_warning_line(monkeypatch, tmp_path, capfd):
    monkeypatch.setitem(sys.modules, "wandb", None)          # `import wandb` now raises ImportError
    assert log(WandbConfig(mode="offline"), tmp_path) is None
    (line,) = warning_lines(capfd.readouterr().err)
    assert "wandb is not installed" in line


def test_disabled_logs_nothing(tmp_path, capfd):
    assert log(WandbConfig(mode="disabled", dir=str(tmp_path / "wandb")), tmp_path) is None
    assert not (tmp_path / "wandb").exists() and not warning_lines(capfd.readouterr().err)


def test_bad_settings_are_refused_before_any_run():
    with pytest.raises(ValueError, match="wandb.mode"):
        WandbConfig(mode="cloud")
    with pytest.raises(ValueError, match="init_timeout"):
        WandbConfig(init_timeout=0)


@pytest.mark.slow   # a whole job: model, runs, report figures
def test_a_job_with_wandb_misconfigured_still_finishes(unreachable_wandb, compose_config, registry, tmp_path, capfd):
    raw = compose_config(tmp_path, "kv_cache=contiguous", "wandb.mode=online", "wandb.entity=no-such-entity",
                         *SMALL)
    folder = run_job(raw, registry)
    assert (folder.path / "done.json").exists() and (folder.path / "report.md").exists()
    done = (folder.path / "done.json").read_text()
    assert "offline-run-" in done
    assert len(warning_lines(capfd.readouterr().err)) == 1


# -- what an offline run holds, read back from its .wandb file ---------------------------------------------

def wandb_records(run_dir: str | Path) -> list:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log of 32 KiB blocks
    after a 7-byte header: each chunk a 7-byte header, crc32, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("run-*.wandb")
    data, pos, pending, block, records = path.read_bytes(), 7, b"", 32768, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:      # too little room left for a header: the block is padded
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):     # wandb's service is still writing this chunk: read it next time
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):
            pending += chunk
        elif kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            records.append(record)
            pending = b""
    return records


def read_back(run_dir: str | Path) -> dict:
    """config, summary (the last value of each key), history (one dict per step) and exit code."""
    import json

    def items(entries) -> dict:
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    out = {"config": {}, "summary": {}, "history": [], "exit_code": None}
    deadline = time.monotonic() + 30
    records = wandb_records(run_dir)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.5)           # wandb's service may write the last records just after finish() returns
        records = wandb_records(run_dir)
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["config"] |= items(record.run.config.update)
        elif kind == "config":
            out["config"] |= items(record.config.update)
        elif kind == "summary":
            out["summary"] |= items(record.summary.update)
        elif kind == "history":
            out["history"].append(items(record.history.item))
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def job_frames():
    """A summary and runs as a job writes them: two arms, three rounds, a grid of one key."""
    rows = []
    for arm, scale in (("recompute", 1.0), ("kv_cache", 0.5)):
        for repeat in range(3):
            rows.append({"output_len": 64, "arm": arm, "repeat": repeat, "status": "ok",
                         "duration_s": scale * (10 + repeat), "output_throughput_tok_s": 100 / scale,
                         **{f"{m}_{p}_ms": scale * (k + 1) * (repeat + 1) for k, m in enumerate(("ttft", "tpot"))
                            for p in ("p50", "p90", "p99")},
                         "e2e_p99_ms": 900.0 * scale, "goodput_req_s": 2.0 / scale,
                         "goodput_ttft_req_s": 3.0 / scale, "ttft_slo_attained": 0.25 * (repeat + 1)})
    runs = pd.DataFrame(rows)
    summary = runs.groupby(["output_len", "arm"], sort=False).median(numeric_only=True).reset_index()
    summary = summary.drop(columns="repeat").assign(status="ok", speedup=[1.0, 2.0], speedup_ci_low=[1.0, 1.9],
                                                    speedup_ci_high=[1.0, 2.1], ppl_ratio=[1.0, 1.01],
                                                    token_agreement=[1.0, 0.97], quality_flag=["", "ok"])
    return summary, runs


def test_an_offline_run_holds_summary_per_round_history_tables_and_context(tmp_path, capfd):
    from ablate.report.wandb_log import summary_metrics

    summary, runs = job_frames()
    requests = pd.DataFrame({"arm": ["kv_cache"] * 4, "repeat": 0, "ttft_s": [0.1, 0.2, 0.3, 0.4]})
    run_dir = log_run(WandbConfig(dir=str(tmp_path / "wandb")), name="ch08-abc", group="ch08", tags=["ch08"],
                      config={"model": {"name": "tiny"}}, summary=summary_metrics(summary, ["output_len"]),
                      tables={"summary": summary, "runs": runs, "requests": requests}, images={},
                      default_dir=tmp_path, runs=runs, point_keys=["output_len"],
                      peaks={"bandwidth_bytes_s": 1e11, "source": "table"}, environment={"python": "3.11"})
    out, err = capfd.readouterr()
    assert "wandb" not in out.lower() and "wandb:" not in err     # wandb's banner and sync hints are silenced
    logged = read_back(run_dir)
    assert logged["exit_code"] == 0
    assert logged["config"]["peaks"]["source"] == "table" and logged["config"]["environment"] == {"python": "3.11"}
    assert logged["config"]["model"] == {"name": "tiny"}
    s = logged["summary"]
    for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms", "goodput_req_s",
                "goodput_ttft_req_s", "ttft_slo_attained", "speedup", "ppl_ratio", "token_agreement"):
        assert f"{key}/kv_cache/output_len=64" in s, key
    assert s["goodput_ttft_req_s/kv_cache/output_len=64"] == 6.0 and s["ttft_slo_attained/kv_cache/output_len=64"] == 0.5
    assert s["speedup/kv_cache/output_len=64"] == 2.0 and s["quality_flag/kv_cache/output_len=64"] == "ok"
    assert "quality_flag/recompute/output_len=64" not in s        # an empty flag is no flag
    assert s["requests/_type"] == "table-file" and s["requests/nrows"] == 4
    rounds = [h for h in logged["history"] if "round" in h]
    assert [h["round"] for h in rounds] == [0, 1, 2]
    assert [h["ttft_p99_ms/kv_cache/output_len=64"] for h in rounds] == [0.5, 1.0, 1.5]
    assert rounds[0]["duration_s/recompute/output_len=64"] == 10.0
    assert [h["ttft_slo_attained/kv_cache/output_len=64"] for h in rounds] == [0.25, 0.5, 0.75]


def test_a_failed_job_is_a_run_with_exit_code_1_and_its_error(tmp_path):
    from ablate.report.wandb_log import log_failed_run

    run_dir = log_failed_run(WandbConfig(dir=str(tmp_path / "wandb")), name="ch08-abc", group="ch08", tags=["ch08"],
                             config={"model": {"name": "tiny"}}, error="RuntimeError: CUDA out of memory\n  at ...",
                             default_dir=tmp_path, environment={"device": "cpu"})
    logged = read_back(run_dir)
    assert logged["exit_code"] == 1
    assert logged["summary"]["status"] == "failed"
    assert logged["summary"]["error"] == "RuntimeError: CUDA out of memory at ..."
    assert logged["config"]["environment"] == {"device": "cpu"}
    assert log_failed_run(WandbConfig(mode="disabled"), name="x", group="g", tags=[], config={}, error="e",
                          default_dir=tmp_path) is None


def test_nothing_raises_on_bad_input(tmp_path, capfd):
    from ablate.report.wandb_log import summary_metrics

    assert summary_metrics(pd.DataFrame({"speedup": [2.0]}), []) == {}       # no arm column: nothing, a warning
    run_dir = log_run(WandbConfig(dir=str(tmp_path / "wandb")), name="x", group="g", tags=[], config={},
                      summary={}, tables={"bad": "not a frame"}, images={}, default_dir=tmp_path,
                      runs=pd.DataFrame({"repeat": [0], "arm": ["a"], "duration_s": ["slow"]}))
    assert run_dir is None
    assert len(warning_lines(capfd.readouterr().err)) == 2
