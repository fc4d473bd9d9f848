"""Hydra callbacks for sweeps (registered in conf/config.yaml under hydra.callbacks).

SweepOutcome: which jobs of a sweep failed, listed at its end; `python -m ablate -m` then exits
with status 1 (a sweep whose every job finished exits 0). Each job runs in a process of its own
(ablate.experiment.job_process), so a job killed by a signal is listed too, with the signal.

MeasurePeaksOnce: peak bandwidth and FLOP/s measured while other jobs of a parallel sweep run are
wrong (they share the memory bus), so the launcher process measures them, or checks the cache,
once for every (device, dtype, threads) the sweep's jobs will use, before any job starts, then
sets ABLATE_PEAKS_FROZEN=1: the jobs inherit it (basic and joblib launchers) and only read the
cache. A single run (no -m) does not call this and measures in its own process. Launchers that
run jobs on other machines (submitit's Slurm) are left alone: each job measures on its own node.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ablate.measure import device as dev
from ablate.measure import hardware
from ablate.model.config import DTYPES, resolve_dtype

# swept keys that can change a job's device, dtype, threads or given peaks (others are not expanded)
PEAK_KEYS = ("device", "threads", "peak_bandwidth", "peak_flops", "model", "experiment", "costs")


def peak_targets(config: DictConfig) -> tuple[str, str, float, float] | None:
    """(device, dtype name, given bandwidth, given FLOP/s) a job of this config asks peaks for; None: none."""
    bandwidth, flops = float(config.get("peak_bandwidth") or 0), float(config.get("peak_flops") or 0)
    if OmegaConf.select(config, "experiment.kind", default="") == "costs":   # ablate.measure.cost_devices.this_machine
        if "this-machine" not in list(OmegaConf.select(config, "costs.devices", default=[]) or []):
            return None
        return "cpu", str(config.costs.dtype), bandwidth, flops
    return str(config.get("device", "auto")), str(config.model.dtype), bandwidth, flops


def job_threads(config: DictConfig) -> int:
    """torch's thread count in a job: `threads` if given, else the launcher's default (joblib's loky
    workers get OMP_NUM_THREADS = cpu_count // n_jobs unless it is set), else this process's."""
    if config.get("threads"):
        return int(config.threads)
    if "joblib" in str(OmegaConf.select(config, "hydra.launcher._target_", default="")).lower():
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            return int(os.environ["OMP_NUM_THREADS"])
        from joblib import cpu_count
        n_jobs = int(OmegaConf.select(config, "hydra.launcher.n_jobs", default=-1) or -1)
        n_jobs = max(cpu_count() + 1 + n_jobs, 1) if n_jobs < 0 else n_jobs
        return max(cpu_count() // n_jobs, 1)
    return torch.get_num_threads()


def job_configs(config: DictConfig) -> list[DictConfig]:
    """One composed config per combination of the swept values of PEAK_KEYS (the sweep's own config
    when Hydra is not running, as in tests, or the sweep cannot be expanded, e.g. another sweeper)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser
        if not GlobalHydra.instance().is_initialized() or "hydra" not in config:
            return [config]
        loader = GlobalHydra.instance().config_loader()
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
        args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(args)
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        swept = [o for o in parsed if o.is_sweep_override()
                 and o.key_or_group.lstrip("+~").split(".")[0].split("/")[0] in PEAK_KEYS]
        if not swept:
            return [config]
        return [loader.load_sweep_config(config, fixed + job) for job in BasicSweeper.split_arguments(swept, None)[0]]
    except Exception as err:  # noqa: BLE001  (a sweep the basic sweeper cannot expand: its base config only)
        print(f"peaks: could not expand the sweep ({type(err).__name__}: {err}); measuring its base config only")
        return [config]


def measure_once(device_name: str, dtype_name: str, threads: int, bandwidth: float, flops: float) -> hardware.Peaks:
    """hardware.peaks at `threads` torch threads (this process's count restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        device = dev.resolve(device_name)      # model.dtype=auto: the dtype the jobs resolve on this device
        return hardware.peaks(device, DTYPES[resolve_dtype(dtype_name, device)], bandwidth, flops)
    finally:
        torch.set_num_threads(before)


class MeasurePeaksOnce(Callback):
    def __init__(self) -> None:
        self._before: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._before = os.environ.get(hardware.FROZEN_ENV)
        if "slurm" in str(OmegaConf.select(config, "hydra.launcher._target_", default="")).lower():
            print("peaks: jobs run on other machines (Slurm); each measures its own, or reads its cache")
            return
        os.environ.pop(hardware.FROZEN_ENV, None)       # this process may measure; jobs will not
        targets = {}
        for job in job_configs(config):
            target = peak_targets(job)
            if target is not None:
                targets[(*target, job_threads(job))] = None
        for device_name, dtype_name, bandwidth, flops, threads in targets:
            try:
                p = measure_once(device_name, dtype_name, threads, bandwidth, flops)
            except (ValueError, KeyError, RuntimeError) as err:   # the jobs will report it themselves
                print(f"peaks: not measured for device={device_name} dtype={dtype_name}: {err}")
                continue
            print(f"peaks ({p.source}, before the sweep): bandwidth {p.bandwidth_bytes_s / 1e9:.1f} GB/s, "
                  f"matmul {p.flops / 1e9:.1f} GFLOP/s ({dtype_name}, {threads} threads, {device_name}; "
                  f"measured {p.measured_at or 'never: given'}); jobs only read the cache")
        os.environ[hardware.FROZEN_ENV] = "1"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """This process's ABLATE_PEAKS_FROZEN as it was before the sweep."""
        if self._before is None:
            os.environ.pop(hardware.FROZEN_ENV, None)
        else:
            os.environ[hardware.FROZEN_ENV] = self._before


JOB_STATUS_FILE = "ablate_job.json"     # in each job's Hydra output folder: {"status": ..., "error": ...}
FAILED_JOBS: list[str] = []             # the last sweep's failed jobs, for the CLI's exit status


def write_job_status(job_dir: str, status: str, error: str = "") -> None:
    """What became of one job (done | failed | config error), read by SweepOutcome at the sweep's end."""
    from ablate.results import write_atomic
    write_atomic(Path(job_dir) / JOB_STATUS_FILE, json.dumps({"status": status, "error": error}))


class SweepOutcome(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Every job's status file under the sweep folder; the failed ones printed, one line each."""
        FAILED_JOBS.clear()
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir", default=".")))
        statuses = {}
        for file in sorted(sweep_dir.glob(f"*/{JOB_STATUS_FILE}")):
            try:
                statuses[file.parent.name] = json.loads(file.read_text())
            except (OSError, ValueError):
                statuses[file.parent.name] = {"status": "failed", "error": f"unreadable {file}"}
        FAILED_JOBS.extend(f"[job {name}] {s['status']}: {s.get('error', '')}"
                           for name, s in statuses.items() if s.get("status") != "done")
        if FAILED_JOBS:
            print(f"\nsweep: {len(FAILED_JOBS)} of {len(statuses)} jobs did not finish:", *FAILED_JOBS, sep="\n  ")
        elif statuses:
            print(f"\nsweep: all {len(statuses)} jobs finished")
