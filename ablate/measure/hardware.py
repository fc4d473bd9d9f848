"""Peak memory bandwidth and matmul throughput of this machine, measured (or given in config).

Bandwidth: a copy of a buffer far larger than the last-level cache (~300 MiB on the CI CPUs),
filled with data first (untouched pages read as the shared zero page and flatter the figure);
bytes moved = read + write. FLOP/s: the best of a few large square matmuls in the model's dtype.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ablate.measure import device as dev

CACHE_DIR = Path.home() / ".cache" / "ablate"


@dataclass(frozen=True)
class Peaks:
    bandwidth_bytes_s: float
    flops: float
    source: str       # measured | config | cached

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.flops <= 0:
            raise ValueError("peak bandwidth and peak FLOP/s must be positive")


def measure_bandwidth(device: torch.device, num_bytes: int = 2 << 30, repeats: int = 3) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = dev.now(device)
        dst.copy_(src)
        best = min(best, dev.now(device) - start)
    del src, dst
    return 2 * num_bytes / best


def measure_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = dev.now(device)
        a @ b
        best = min(best, dev.now(device) - start)
    return 2 * n**3 / best


def peaks(device: torch.device, dtype: torch.dtype, bandwidth: float = 0.0, flops: float = 0.0,
          use_cache: bool = True) -> Peaks:
    """Given values win; else a cached measurement of this device and dtype; else measure now."""
    if bandwidth and flops:
        return Peaks(bandwidth, flops, "config")
    info = dev.describe(device)
    key = f"{info['device_name']}-{device.type}-{dtype}-{torch.get_num_threads()}-{torch.__version__}"
    path = CACHE_DIR / "peaks.json"
    cached = json.loads(path.read_text()) if use_cache and path.exists() else {}
    if key in cached:
        p = cached[key]
        return Peaks(bandwidth or p["bandwidth_bytes_s"], flops or p["flops"], "cached")
    size = (8 << 30) if device.type == "cuda" else (2 << 30)
    measured = Peaks(measure_bandwidth(device, size), measure_flops(device, dtype), "measured")
    if use_cache:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cached[key] = asdict(measured)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    return Peaks(bandwidth or measured.bandwidth_bytes_s, flops or measured.flops, measured.source)

