"""On-chip SRAM against off-chip memory (HBM, DRAM): sizes and bandwidths per device.

Why attention cares: materialised attention sends its n x n scores through off-chip memory, tiled
attention keeps them in on-chip SRAM (ablate/analysis/attention_io.py); what that buys is about
the ratio of the two bandwidths, and what it costs is that a tile must fit in the SRAM.

GPUs: each SM has one SRAM array split between L1 cache and shared memory (as a kernel asks), and
reads 128 bytes per clock from it (32 banks x 4 bytes). So

    on-chip bandwidth = SMs x 128 B/clock x boost clock
        A100 SXM:        108 x 128 B x 1.41 GHz = 19.5 TB/s   (FlashAttention, Dao et al. 2022: ~19 TB/s)
        H100 SXM, H200:  132 x 128 B x 1.98 GHz = 33.5 TB/s   (the same GH100 chip; H200 has more HBM)
    total SRAM = SMs x SRAM per SM      A100: 108 x 192 KiB = 20.25 MiB; H100: 132 x 256 KiB = 33 MiB

against HBM at 2.04 / 3.35 / 4.8 TB/s (ablate.analysis.devices.DEVICES, the datasheets): ~9-10x, and
~7x on the H200, whose HBM grew faster than its SRAM.

This machine (a CPU): cache sizes from sysfs (/sys/devices/system/cpu/cpu0/cache/index*), and the
bandwidth of a copy (bytes = read + write, as ablate.measure.hardware counts them) measured twice
on one thread: a working set of half the L2 (source + destination, copied many times: it stays in
the core's L2) and one of 8x the last-level cache (at least 256 MiB, at most 1 GiB: it streams from
DRAM). One thread for both, so the ratio is one core's; the DRAM figure is one core's share, below
ablate.measure.hardware's all-thread peak. Its "SRAM per SM" is a core's L1d + L2 (private caches). measure_this_machine() measures (~0.5 s);
onchip_table() only formats what it is given.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import psutil
import torch

from ablate.analysis.devices import DEVICES

SHARED_MEMORY_BYTES_PER_CLOCK = 128      # per SM: 32 banks x 4 bytes (Volta through Hopper)
KIB, MIB = 2**10, 2**20


def shared_memory_bandwidth(num_sms: int, boost_clock_hz: float) -> float:
    """SMs x 128 B/clock x clock: every SM reading its shared memory at full rate."""
    return num_sms * SHARED_MEMORY_BYTES_PER_CLOCK * boost_clock_hz


@dataclass(frozen=True)
class OnChipSpec:
    """A GPU's on-chip memory; its HBM is DEVICES[device] (ablate.analysis.devices)."""

    device: str                      # key of ablate.analysis.devices.DEVICES
    num_sms: int
    sram_per_sm_bytes: int           # combined L1 / shared memory of one SM
    max_shared_per_sm_bytes: int     # the most of it that can be configured as shared memory
    l2_bytes: int
    boost_clock_hz: float
    onchip_bandwidth_bytes_s: float  # all SMs' shared memory at once
    onchip_source: str               # where the on-chip bandwidth comes from
    source: str                      # where the sizes come from

    @property
    def total_sram_bytes(self) -> int:
        return self.num_sms * self.sram_per_sm_bytes

    @property
    def hbm_bytes(self) -> float:
        return DEVICES[self.device].memory_bytes

    @property
    def hbm_bandwidth_bytes_s(self) -> float:
        return DEVICES[self.device].bandwidth_bytes_s


_HOPPER = dict(num_sms=132, sram_per_sm_bytes=256 * KIB, max_shared_per_sm_bytes=228 * KIB, l2_bytes=50 * MIB,
               boost_clock_hz=1.98e9, onchip_bandwidth_bytes_s=shared_memory_bandwidth(132, 1.98e9),
               onchip_source="derived: 132 SMs x 128 B/clock x 1.98 GHz boost = 33.5 TB/s")
ONCHIP: dict[str, OnChipSpec] = {
    "a100-80gb": OnChipSpec(
        "a100-80gb", num_sms=108, sram_per_sm_bytes=192 * KIB, max_shared_per_sm_bytes=164 * KIB, l2_bytes=40 * MIB,
        boost_clock_hz=1.41e9, onchip_bandwidth_bytes_s=19e12,
        onchip_source="FlashAttention (Dao et al. 2022, sec. 2.1) estimate ~19 TB/s; derived: 108 SMs x 128 "
                      "B/clock x 1.41 GHz boost = 19.5 TB/s",
        source="NVIDIA A100 whitepaper (GA100): 108 SMs, 192 KB L1/shared per SM (up to 164 KB shared), "
               "40 MB L2"),
    "h100-sxm": OnChipSpec(
        "h100-sxm", **_HOPPER,
        source="NVIDIA H100 whitepaper (GH100, SXM5): 132 SMs, 256 KB L1/shared per SM (up to 228 KB "
               "shared), 50 MB L2, 1.98 GHz max boost"),
    "h200": OnChipSpec(
        "h200", **_HOPPER,
        source="NVIDIA H200 datasheet: the H100's GH100 chip (132 SMs, 256 KB L1/shared per SM, 50 MB L2) "
               "with 141 GB of HBM3e"),
}


@dataclass(frozen=True)
class CacheLevel:
    level: int
    kind: str          # Data | Unified (instruction caches are left out)
    size_bytes: int    # one instance (one core's L1 and L2; the L3 its cores share)


def cache_levels(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> list[CacheLevel]:
    """CPU 0's data and unified caches from sysfs, innermost first; [] where sysfs has none."""
    levels = []
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            levels.append(CacheLevel(int(level), kind, _size_bytes(size)))
    return sorted(levels, key=lambda c: c.level)


def _size_bytes(text: str) -> int:
    """sysfs sizes: '32K', '1024K', '32M' (binary units)."""
    units = {"K": KIB, "M": MIB, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


@dataclass(frozen=True)
class MeasuredBandwidth:
    cache_bytes_s: float        # copy of cache_working_set bytes (source + destination)
    memory_bytes_s: float       # copy of memory_working_set bytes
    cache_working_set: int
    memory_working_set: int
    method: str

    @property
    def ratio(self) -> float:
        return self.cache_bytes_s / self.memory_bytes_s


def _copy_bandwidth(working_set: int, budget_s: float, repeats: int = 3) -> float:
    """2 x half the working set / seconds per copy: best of `repeats` timings of as many copies as
    fill budget_s / repeats (a small copy takes microseconds, near the clock's resolution)."""
    src = torch.empty(working_set // 8, dtype=torch.float32, device="cpu").uniform_()   # 4-byte elements, half the set each
    dst = torch.empty_like(src).fill_(1.0)                                 # touched: no lazily mapped pages
    start = time.perf_counter()
    dst.copy_(src)
    calls = max(1, int(budget_s / repeats / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            dst.copy_(src)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * src.numel() * 4 / best


def measure_this_machine(levels: list[CacheLevel] | None = None, budget_s: float = 0.1) -> MeasuredBandwidth:
    """Copy bandwidth of a working set in L2 against one far beyond the last-level cache, on one thread."""
    levels = cache_levels() if levels is None else levels
    l2 = next((c.size_bytes for c in levels if c.level == 2), 512 * KIB)
    last = max((c.size_bytes for c in levels), default=32 * MIB)
    cache_set, memory_set = max(64 * KIB, l2 // 2), min(1 << 30, max(256 * MIB, 8 * last))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache, memory = _copy_bandwidth(cache_set, budget_s), _copy_bandwidth(memory_set, budget_s)
    finally:
        torch.set_num_threads(threads)
    return MeasuredBandwidth(cache, memory, cache_set, memory_set,
                             f"copy (read + write) on 1 thread, best of 3: {cache_set // KIB:,} KiB working set "
                             f"(half the L2) vs {memory_set // MIB:,} MiB (8x the last-level cache, >= 256 MiB)")


def onchip_table(measured: MeasuredBandwidth | None, levels: list[CacheLevel] | None = None,
                 devices: tuple[str, ...] = tuple(ONCHIP)) -> pd.DataFrame:
    """One row per GPU of ONCHIP, and this machine when `measured` is given (levels: its caches)."""
    unknown = [d for d in devices if d not in ONCHIP]
    if unknown:
        raise ValueError(f"onchip_table: unknown devices {unknown}; choose from {list(ONCHIP)}")
    rows = [{"device": DEVICES[key].name, "SMs / cores": spec.num_sms,
             "SRAM per SM KiB": spec.sram_per_sm_bytes / KIB, "shared max KiB": spec.max_shared_per_sm_bytes / KIB,
             "SRAM total MiB": spec.total_sram_bytes / MIB, "L2 / LLC MiB": spec.l2_bytes / MIB,
             "HBM / DRAM GB": spec.hbm_bytes / 1e9, "off-chip TB/s": spec.hbm_bandwidth_bytes_s / 1e12,
             "on-chip TB/s": spec.onchip_bandwidth_bytes_s / 1e12,
             "on-chip / off-chip": spec.onchip_bandwidth_bytes_s / spec.hbm_bandwidth_bytes_s,
             "on-chip bandwidth from": spec.onchip_source, "source": spec.source}
            for key, spec in ((k, ONCHIP[k]) for k in devices)]
    if measured is not None:
        levels = cache_levels() if levels is None else levels
        size, cores = {c.level: c.size_bytes for c in levels}, os.cpu_count() or 1
        per_core = size.get(1, 0) + size.get(2, 0)      # L1d + L2, private to a core
        rows.append({"device": "this machine (CPU; bandwidths of one core)", "SMs / cores": cores,
                     "SRAM per SM KiB": per_core / KIB, "shared max KiB": float("nan"),
                     "SRAM total MiB": cores * per_core / MIB, "L2 / LLC MiB": max(size.values(), default=0) / MIB,
                     "HBM / DRAM GB": psutil.virtual_memory().total / 1e9,
                     "off-chip TB/s": measured.memory_bytes_s / 1e12, "on-chip TB/s": measured.cache_bytes_s / 1e12,
                     "on-chip / off-chip": measured.ratio,
                     "on-chip bandwidth from": f"measured: {measured.method}",
                     "source": "caches: " + ", ".join(f"L{c.level} {c.kind.lower()} {c.size_bytes // KIB:,} KiB"
                                                      for c in levels)})
    return pd.DataFrame(rows).round({"SRAM total MiB": 2, "HBM / DRAM GB": 1, "off-chip TB/s": 3, "on-chip TB/s": 3,
                                     "on-chip / off-chip": 1})
