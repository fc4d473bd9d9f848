"""Peak memory bandwidth and matmul throughput of this machine, measured (or given in config).

Bandwidth: a copy of a buffer far larger than the last-level cache (~300 MiB on the CI CPUs),
filled with data first (untouched pages read as the shared zero page and flatter the figure);
bytes moved = read + write. FLOP/s: the best of a few large square matmuls in the model's dtype.
On the CPU both are timed by the wall clock (best of a few). On a GPU a 2048^3 matmul takes ~20 us
on an H200, so launch overhead would dominate: there the matmul is sized for the device (8192^3
of random data: zeros would let the tensor cores idle at lower power), the copy is 4 GiB device to
device (far beyond the 60 MB L2), and each is timed by CUDA events, the median of CUDA_REPEATS
after warm-ups. Every figure records how it was measured (Peaks.method; a cache entry measured
another way is measured again).

Measurements are cached in CACHE_DIR/peaks.json, one entry per machine identity (hostname, CPU
model, logical CPUs, RAM; GPU name and memory on CUDA) x device type x dtype x torch threads x torch
version. An entry records when it was measured and is measured again after STALE_AFTER, or when
the machine it was measured on differs. A corrupt cache file is reported in one line and replaced.

Sweeps: a measurement taken while other jobs run is wrong (memory bandwidth is shared), so a
multirun measures once in the launcher before any job starts (ablate.experiment.sweep_callbacks)
and sets ABLATE_PEAKS_FROZEN=1; with it set, `peaks` only reads the cache (whatever the entry's
age) and raises PeaksUnavailable when it has no entry: the caller runs without peaks (MBU, MFU and
the roofline prediction left empty) and prints the reason.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psutil
import torch

from ablate.api import clock
from ablate.measure import device as dev

CACHE_DIR = Path.home() / ".cache" / "ablate"
CACHE_FILE = "peaks.json"
STALE_AFTER = timedelta(days=7)          # a cached measurement older than this is measured again
FROZEN_ENV = "ABLATE_PEAKS_FROZEN"       # "1": never measure, only read the cache (set during sweeps)
BANDWIDTH_BUFFER_BYTES = {"cuda": 4 << 30, "cpu": 2 << 30}
CUDA_MATMUL_N = 8192          # 2 n^3 = 1.1 TFLOP: ~1 ms in bf16 on an H200, launch overhead < 1 %
CUDA_WARMUPS, CUDA_REPEATS = 5, 20
CPU_METHOD = "wall clock: copy of 2 GiB (read + write), best of 3; 2048^3 matmul, best of 5 after 1 warm-up"


class PeaksUnavailable(RuntimeError):
    """No peaks to use: measuring is frozen (a parallel sweep runs) and the cache has no entry."""


@dataclass(frozen=True)
class Peaks:
    bandwidth_bytes_s: float
    flops: float
    source: str              # measured | cached | config | config+measured | config+cached (some given)
    measured_at: str = ""    # UTC ISO time of the measurement ("" when both figures were given)
    machine: str = ""        # the machine identity in one line (machine_label)
    threads: int = 0         # torch intra-op threads the figures hold for
    dtype: str = ""          # the matmul dtype of `flops` (bfloat16, float32, ...)
    method: str = ""         # how the figures were measured (probe_method); "" when both were given

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.flops <= 0:
            raise ValueError("peak bandwidth and peak FLOP/s must be positive")

    def record(self) -> dict[str, Any]:
        """What a run records about its peaks (environment.json, the W&B config), in readable units."""
        return {"peak_bandwidth_gb_s": self.bandwidth_bytes_s / 1e9, "peak_flops_gflop_s": self.flops / 1e9,
                "source": self.source, "measured_at": self.measured_at, "machine": self.machine,
                "threads": self.threads, "dtype": self.dtype, "method": self.method}


def machine_identity(device: torch.device) -> dict[str, Any]:
    """What identifies the machine a measurement holds for: a cache entry from another is not used."""
    ident: dict[str, Any] = {"hostname": socket.gethostname(), "cpu": dev._cpu_name(),
                             "cpu_count": os.cpu_count() or 0, "memory_bytes": psutil.virtual_memory().total}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ident |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory}
    return ident


def machine_label(ident: dict[str, Any]) -> str:
    label = (f"{ident['hostname']}: {ident['cpu']} x{ident['cpu_count']}, "
             f"{ident['memory_bytes'] / 2**30:.1f} GiB RAM")
    if "gpu" in ident:
        label += f"; {ident['gpu']} {ident['gpu_memory_bytes'] / 2**30:.1f} GiB"
    return label


def cuda_sizes(device: torch.device) -> tuple[int, int]:
    """(copy buffer bytes, matmul n) on this GPU: BANDWIDTH_BUFFER_BYTES and CUDA_MATMUL_N, smaller
    on a GPU with under 64 GiB, so that the probes (2 buffers; 3 n x n matrices) take <= 1/8 of it."""
    total = torch.cuda.get_device_properties(device).total_memory
    copy_bytes, n = min(BANDWIDTH_BUFFER_BYTES["cuda"], total // 16), CUDA_MATMUL_N
    while n > 1024 and 3 * n * n * 4 > total // 8:
        n //= 2
    return copy_bytes, n


def probe_method(device: torch.device) -> str:
    """How `peaks` measures on this device, recorded with the figures and checked against a cache entry."""
    if device.type != "cuda":
        return CPU_METHOD
    copy_bytes, n = cuda_sizes(device)
    return (f"CUDA events, median of {CUDA_REPEATS} after {CUDA_WARMUPS} warm-ups: device-to-device copy of "
            f"{copy_bytes / 2**30:g} GiB (read + write); {n}^3 matmul of random data "
            f"(allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
            f"float32_matmul_precision={torch.get_float32_matmul_precision()})")


def cuda_median_s(fn, warmups: int = CUDA_WARMUPS, repeats: int = CUDA_REPEATS) -> float:
    """Median seconds of fn() on the GPU, each timed by a pair of CUDA events around it (no host
    clock, no synchronisation inside the timed span), after `warmups` untimed calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)    # milliseconds -> seconds
    return statistics.median(times)


def cuda_bandwidth(device: torch.device, num_bytes: int, repeats: int = CUDA_REPEATS) -> float:
    """Bytes/s of a device-to-device copy: 2 x num_bytes (each byte read once and written once) / time."""
    def timed() -> float:
        src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        return cuda_median_s(lambda: dst.copy_(src), warmups=3, repeats=repeats)

    seconds = timed()
    torch.cuda.empty_cache()    # the buffers back to the driver: else free memory (the KV budget) reads GiBs less
    return 2 * (num_bytes // 4 * 4) / seconds


def cuda_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = CUDA_REPEATS) -> float:
    """FLOP/s of an n x n x n matmul of random data (2 n^3 FLOPs: a multiply and an add per term)."""
    def timed() -> float:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        return cuda_median_s(lambda: torch.matmul(a, b, out=out), repeats=repeats)

    seconds = timed()
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def measure_bandwidth(device: torch.device, num_bytes: int = 2 << 30, repeats: int = 3) -> float:
    if device.type == "cuda":
        return cuda_bandwidth(device, num_bytes)
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = clock.now(device)
        dst.copy_(src)
        best = min(best, clock.now(device) - start)
    del src, dst
    return 2 * num_bytes / best


def measure_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    if device.type == "cuda":
        return cuda_flops(device, dtype, cuda_sizes(device)[1])
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = clock.now(device)
        a @ b
        best = min(best, clock.now(device) - start)
    return 2 * n**3 / best


def frozen() -> bool:
    return os.environ.get(FROZEN_ENV, "") not in ("", "0")


def peaks(device: torch.device, dtype: torch.dtype, bandwidth: float = 0.0, flops: float = 0.0,
          use_cache: bool = True) -> Peaks:
    """Given values win; else a fresh cached measurement of this machine, device, dtype and thread
    count; else measure now (and cache it). Under ABLATE_PEAKS_FROZEN=1 nothing is measured: a
    cached entry of any age is used, and without one this raises PeaksUnavailable."""
    ident = machine_identity(device)
    threads, dtype_name = torch.get_num_threads(), str(dtype).removeprefix("torch.")
    common = {"machine": machine_label(ident), "threads": threads, "dtype": dtype_name}
    if bandwidth and flops:
        return Peaks(bandwidth, flops, "config", **common)
    key = f"{common['machine']} | {device.type} | {dtype_name} | {threads} threads | torch {torch.__version__}"
    path = CACHE_DIR / CACHE_FILE
    entry = _read_cache(path).get(key) if use_cache else None
    is_frozen, method = frozen(), probe_method(device)
    if entry is not None and not _usable(entry, ident, method, max_age=None if is_frozen else STALE_AFTER):
        entry = None
    if entry is not None:
        source = "cached"
    elif is_frozen:
        raise PeaksUnavailable(
            f"no cached peaks for {key} and {FROZEN_ENV}=1 (a sweep is running; measuring now would "
            f"read other jobs' load): run once with these settings outside the sweep, or give "
            f"peak_bandwidth= and peak_flops=")
    else:
        size = cuda_sizes(device)[0] if device.type == "cuda" else BANDWIDTH_BUFFER_BYTES.get(device.type, 2 << 30)
        entry = {"bandwidth_bytes_s": measure_bandwidth(device, size), "flops": measure_flops(device, dtype),
                 "measured_at": _now().isoformat(timespec="seconds"), "machine": ident,
                 "threads": threads, "dtype": dtype_name, "method": method}
        source = "measured"
        busy = _busy(device)
        if busy:      # other work shared the memory bus: good for this run at most, never cached
            print(f"peaks: measured while the machine was busy ({busy}); not cached, measured again next run",
                  file=sys.stderr)
            source = "measured-busy"
        elif use_cache:
            _write_entry(path, key, entry)
    if bandwidth or flops:
        source = f"config+{source}"
    return Peaks(bandwidth or entry["bandwidth_bytes_s"], flops or entry["flops"], source,
                 entry["measured_at"], **common, method=entry.get("method", CPU_METHOD))


def _busy(device: torch.device) -> str:
    """Why this machine's CPUs are not free for a measurement ('' when they are): a 1-minute load
    average above half the logical CPUs, not counting this process's own threads. CPU only: a GPU's
    copy and matmul do not share the host's cores."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return ""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    return f"1-minute load {load:.2f} on {cpus} CPUs" if load > 0.5 * cpus + 1 else ""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _usable(entry: Any, ident: dict[str, Any], method: str, max_age: timedelta | None) -> bool:
    """Same machine, the same probes (an entry without a method is from the wall-clock probes,
    still CPU_METHOD), positive figures, a readable time, and (unless max_age is None) fresh."""
    try:
        measured_at = datetime.fromisoformat(entry["measured_at"])
        if measured_at.tzinfo is None:
            measured_at = measured_at.replace(tzinfo=timezone.utc)
        ok = (entry["machine"] == ident and entry.get("method", CPU_METHOD) == method
              and float(entry["bandwidth_bytes_s"]) > 0 and float(entry["flops"]) > 0)
    except (KeyError, TypeError, ValueError):
        return False
    return ok and (max_age is None or _now() - measured_at <= max_age)


def _read_cache(path: Path, warn: bool = True) -> dict[str, Any]:
    """The cache's entries; {} when there is none, and (with a one-line warning) when it is corrupt."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as err:
        if warn:
            print(f"warning: ignoring the corrupt peaks cache {path} ({type(err).__name__}: {err}); "
                  "it will be overwritten", file=sys.stderr)
        return {}
    if not isinstance(data, dict):
        if warn:
            print(f"warning: ignoring the corrupt peaks cache {path} (not a JSON object); it will be "
                  "overwritten", file=sys.stderr)
        return {}
    return data


def _write_entry(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one entry, re-reading the file first (another process may have written since); atomic.
    Entries of the older format (no measured_at) are dropped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cached = {k: v for k, v in _read_cache(path, warn=False).items() if isinstance(v, dict) and "measured_at" in v}
    cached[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
