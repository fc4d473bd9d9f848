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
