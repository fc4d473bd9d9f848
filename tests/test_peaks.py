"""Peak bandwidth / FLOP/s: the cache (identity, staleness, corruption), frozen sweeps, the record,
and the sweep callback that measures once before the jobs start. Measurements are monkeypatched."""
from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
from omegaconf import OmegaConf

from ablate.experiment import sweep_callbacks
from ablate.measure import hardware

BW, FLOPS = 12.9e9, 5.0e10


REAL_BUSY = hardware._busy


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """A temporary cache; measurements return BW and FLOPS and are counted here."""
    counted = {"bandwidth": 0, "flops": 0}

    def bandwidth(device, num_bytes=0, repeats=3):
        counted["bandwidth"] += 1
        return BW

    def flops(device, dtype, n=2048, repeats=5):
        counted["flops"] += 1
        return FLOPS

    monkeypatch.setattr(hardware, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(hardware, "measure_bandwidth", bandwidth)
    monkeypatch.setattr(hardware, "measure_flops", flops)
    monkeypatch.setattr(hardware, "_busy", lambda device: "")     # as if the machine were idle (CI may not be)
    monkeypatch.setenv(hardware.FROZEN_ENV, "0")     # recorded, so teardown removes what a test sets
    monkeypatch.delenv(hardware.FROZEN_ENV)
    threads = torch.get_num_threads()
    yield counted
    torch.set_num_threads(threads)


def cache_file():
    return hardware.CACHE_DIR / hardware.CACHE_FILE


def peaks(dtype=torch.float32, **kw):
    return hardware.peaks(torch.device("cpu"), dtype, **kw)


def test_the_real_measurements_are_positive_on_tiny_buffers():
    assert hardware.measure_bandwidth(torch.device("cpu"), 1 << 20, repeats=1) > 0
    assert hardware.measure_flops(torch.device("cpu"), torch.float32, n=32, repeats=1) > 0


def test_measured_once_then_read_from_the_cache(calls):
    first = peaks()
    assert (first.source, first.bandwidth_bytes_s, first.flops) == ("measured", BW, FLOPS)
    second = peaks()
    assert second.source == "cached"
    assert (second.bandwidth_bytes_s, second.flops, second.measured_at) == (BW, FLOPS, first.measured_at)
    assert calls == {"bandwidth": 1, "flops": 1}
    [entry] = json.loads(cache_file().read_text()).values()
    assert entry["machine"] == hardware.machine_identity(torch.device("cpu"))
    assert entry["threads"] == torch.get_num_threads() and entry["dtype"] == "float32"
    assert entry["measured_at"] == first.measured_at and first.measured_at.endswith("+00:00")


def test_a_measurement_on_a_busy_machine_is_used_once_and_never_cached(calls, monkeypatch, capsys):
    monkeypatch.setattr(hardware, "_busy", REAL_BUSY)
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (4.0 * (hardware.os.cpu_count() or 1),) * 3)
    busy = peaks()
    assert busy.source == "measured-busy" and busy.bandwidth_bytes_s == BW
    assert "measured while the machine was busy" in capsys.readouterr().err
    assert not cache_file().exists()
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (0.1, 0.1, 0.1))      # idle: measured and cached
    assert peaks().source == "measured" and peaks().source == "cached"
    assert calls == {"bandwidth": 2, "flops": 2}


def test_a_stale_entry_is_measured_again(calls, monkeypatch):
    start = hardware._now()
    peaks()
    monkeypatch.setattr(hardware, "_now", lambda: start + hardware.STALE_AFTER - timedelta(hours=1))
    assert peaks().source == "cached"
    later = start + hardware.STALE_AFTER + timedelta(hours=1)
    monkeypatch.setattr(hardware, "_now", lambda: later)
    again = peaks()
    assert again.source == "measured" and calls["bandwidth"] == 2
    assert again.measured_at == later.isoformat(timespec="seconds")
    assert peaks().source == "cached"            # the re-measurement replaced the stale entry


def test_another_machine_identity_is_measured_again(calls, monkeypatch):
    here = peaks()
    real = hardware.machine_identity
    monkeypatch.setattr(hardware, "machine_identity", lambda device: {**real(device), "hostname": "elsewhere"})
    there = peaks()
    assert there.source == "measured" and calls["bandwidth"] == 2
    assert there.machine.startswith("elsewhere:") and here.machine != there.machine
    assert len(json.loads(cache_file().read_text())) == 2


def test_an_entry_whose_recorded_machine_differs_is_not_used(calls):
    peaks()
    data = json.loads(cache_file().read_text())
    [key] = data
    data[key]["machine"]["memory_bytes"] += 1
    cache_file().write_text(json.dumps(data))
    assert peaks().source == "measured" and calls["bandwidth"] == 2


def test_another_thread_count_is_measured_again(calls):
    torch.set_num_threads(1)
    one = peaks()
    torch.set_num_threads(2)
    two = peaks()
    assert (one.source, two.source, one.threads, two.threads) == ("measured", "measured", 1, 2)
    torch.set_num_threads(1)
    assert peaks().source == "cached"
    assert calls["bandwidth"] == 2


def test_another_dtype_is_measured_again(calls):
    peaks(torch.float32)
    p = peaks(torch.bfloat16)
    assert p.source == "measured" and p.dtype == "bfloat16" and calls["flops"] == 2


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_a_corrupt_cache_is_reported_in_one_line_and_overwritten(calls, capsys, text):
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text(text, encoding="latin-1")
    p = peaks()
    err = capsys.readouterr().err
    assert p.source == "measured"
    assert err.count("\n") == 1 and err.startswith("warning: ignoring the corrupt peaks cache")
    [entry] = json.loads(cache_file().read_text()).values()
    assert entry["bandwidth_bytes_s"] == BW
    assert peaks().source == "cached" and capsys.readouterr().err == ""


def test_a_broken_entry_is_measured_again_and_old_format_entries_are_dropped(calls):
    peaks()
    data = json.loads(cache_file().read_text())
    [key] = data
    data[key]["flops"] = -1.0
    data["cpu-cpu-torch.float32-2-2.x"] = {"bandwidth_bytes_s": 43.9e9, "flops": 1e11, "source": "measured"}
    cache_file().write_text(json.dumps(data))
    assert peaks().flops == FLOPS and calls["flops"] == 2
    assert list(json.loads(cache_file().read_text())) == [key]


def test_frozen_without_a_cache_entry_raises_and_does_not_measure(calls, monkeypatch):
    monkeypatch.setenv(hardware.FROZEN_ENV, "1")
    with pytest.raises(hardware.PeaksUnavailable, match="ABLATE_PEAKS_FROZEN=1"):
        peaks()
    assert calls == {"bandwidth": 0, "flops": 0} and not cache_file().exists()
    given = peaks(bandwidth=1e10, flops=1e11)             # given figures need no measurement
    assert (given.source, given.bandwidth_bytes_s, given.measured_at) == ("config", 1e10, "")


def test_frozen_uses_a_cached_entry_even_when_stale(calls, monkeypatch):
    start = hardware._now()
    peaks()
    monkeypatch.setattr(hardware, "_now", lambda: start + 3 * hardware.STALE_AFTER)
    monkeypatch.setenv(hardware.FROZEN_ENV, "1")
    assert peaks().source == "cached" and calls["bandwidth"] == 1


def test_a_partly_given_pair_says_so(calls):
    p = peaks(bandwidth=3e9)
    assert (p.source, p.bandwidth_bytes_s, p.flops) == ("config+measured", 3e9, FLOPS)
    assert peaks(flops=7e9).source == "config+cached"


def test_record_has_readable_units_and_provenance(calls):
    torch.set_num_threads(1)
    p = peaks(torch.bfloat16)
    rec = p.record()
    assert set(rec) == {"peak_bandwidth_gb_s", "peak_flops_gflop_s", "source", "measured_at", "machine",
                        "threads", "dtype", "method"}
    assert rec["method"] == hardware.CPU_METHOD                  # how the figures were measured
    assert rec["peak_bandwidth_gb_s"] == pytest.approx(12.9) and rec["peak_flops_gflop_s"] == pytest.approx(50.0)
    assert (rec["source"], rec["threads"], rec["dtype"]) == ("measured", 1, "bfloat16")
    assert rec["measured_at"] == p.measured_at != ""
    assert rec["machine"] == hardware.machine_label(hardware.machine_identity(torch.device("cpu")))
    json.dumps(rec)                                       # fit for environment.json and the W&B config


def test_peaks_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        hardware.Peaks(0.0, 1e9, "config")
    assert hardware.Peaks(1e9, 1e9, "config").measured_at == ""    # the old three-field call still works


def sweep_config(**top):
    return OmegaConf.create({"device": "cpu", "threads": 1, "peak_bandwidth": 0.0, "peak_flops": 0.0,
                             "model": {"dtype": "fp32"}, "experiment": {"kind": "experiment"}, **top})


def test_the_callback_fills_the_cache_then_freezes_the_jobs(calls, capsys):
    callback = sweep_callbacks.MeasurePeaksOnce()
    callback.on_multirun_start(sweep_config())
    assert "peaks (measured, before the sweep): bandwidth 12.9 GB/s" in capsys.readouterr().out
    assert os.environ[hardware.FROZEN_ENV] == "1"
    [entry] = json.loads(cache_file().read_text()).values()
    assert (entry["threads"], entry["dtype"]) == (1, "float32")
    torch.set_num_threads(1)                                  # what the job does with threads=1
    job = peaks()
    assert job.source == "cached" and calls == {"bandwidth": 1, "flops": 1}
    torch.set_num_threads(2)
    with pytest.raises(hardware.PeaksUnavailable):            # a thread count the sweep did not measure
        peaks()
    callback.on_multirun_end(sweep_config())
    assert hardware.FROZEN_ENV not in os.environ


def test_the_callback_restores_this_processs_thread_count(calls):
    torch.set_num_threads(2)
    sweep_callbacks.MeasurePeaksOnce().on_multirun_start(sweep_config(threads=1))
    assert torch.get_num_threads() == 2


def test_the_callback_validates_a_fresh_cache_without_measuring(calls):
    torch.set_num_threads(1)
    peaks()
    sweep_callbacks.MeasurePeaksOnce().on_multirun_start(sweep_config())
    assert calls == {"bandwidth": 1, "flops": 1}


def test_the_callback_measures_this_machine_for_a_costs_sweep(calls):
    cfg = sweep_config(experiment={"kind": "costs"}, costs={"dtype": "bf16", "devices": ["h100-sxm", "this-machine"]})
    sweep_callbacks.MeasurePeaksOnce().on_multirun_start(cfg)
    [entry] = json.loads(cache_file().read_text()).values()
    assert entry["dtype"] == "bfloat16"
    cfg.costs.devices = ["h100-sxm"]
    assert sweep_callbacks.peak_targets(cfg) is None


def test_the_callback_leaves_slurm_jobs_alone(calls):
    cfg = sweep_config(hydra={"launcher": {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher"
                                                       ".SlurmLauncher"}})
    sweep_callbacks.MeasurePeaksOnce().on_multirun_start(cfg)
    assert hardware.FROZEN_ENV not in os.environ and not cache_file().exists()


def test_job_threads_follows_joblibs_worker_default(monkeypatch):
    from joblib import cpu_count
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    joblib = {"launcher": {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
                           "n_jobs": 2}}
    assert sweep_callbacks.job_threads(sweep_config(threads=3, hydra=joblib)) == 3
    assert sweep_callbacks.job_threads(sweep_config(threads=0, hydra=joblib)) == max(cpu_count() // 2, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert sweep_callbacks.job_threads(sweep_config(threads=0, hydra=joblib)) == 5
    assert sweep_callbacks.job_threads(sweep_config(threads=0)) == torch.get_num_threads()


def test_the_callback_expands_swept_dtypes_and_threads(registry):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from ablate.engine.config_store import register_configs
    from ablate.engine.registry import conf_dir
    register_configs(registry)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = GlobalHydra.instance().hydra.compose_config(
            "config", ["device=cpu", "model.dtype=fp32,bf16", "threads=1,2", "workload.num_requests=1,2,3"],
            run_mode=RunMode.MULTIRUN)
        jobs = sweep_callbacks.job_configs(cfg)
    targets = {(*sweep_callbacks.peak_targets(j), sweep_callbacks.job_threads(j)) for j in jobs}
    assert targets == {("cpu", dtype, 0.0, 0.0, threads) for dtype in ("fp32", "bf16") for threads in (1, 2)}


def test_the_callback_resolves_dtype_auto_as_the_jobs_will(calls):
    """model.dtype=auto (the root config's default): the peaks of the dtype a job resolves on the device."""
    assert sweep_callbacks.measure_once("cpu", "auto", 1, 0.0, 0.0).dtype == "float32"
