"""Devices and servers the cost calculator prices: datasheet figures, this machine, and N of a kind.

A device is one accelerator (DEVICES: dense 16-bit FLOP/s, no sparsity; memory in 10^9-byte GB as
datasheets count) or this machine (bandwidth and matmul FLOP/s measured by
ablate.measure.hardware.peaks, or given; RAM as memory: ablate.measure.cost_devices.this_machine). A server is N identical devices named
`<N>x<device>` (`4xa100-80gb`, `8xh100-sxm`, `8xh200`); a bare device name is a server of one.
What the server holds and reads is worked out in ablate/analysis/servers.py (tensor parallelism).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

THIS_MACHINE = "this-machine"
SERVER_SYNTAX = "<N>x<device>, N a positive integer (4xa100-80gb), or a device alone"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bandwidth_bytes_s: float    # peak memory bandwidth
    flops: float                # peak dense FLOP/s in 16-bit (bf16/fp16) matmuls
    memory_bytes: float         # device memory (10^9-byte GB as datasheets count)
    source: str


DEVICES: dict[str, DeviceSpec] = {
    "a100-80gb": DeviceSpec("A100 80GB SXM", 2.039e12, 312e12, 80e9,
                            "NVIDIA A100 datasheet: HBM2e 2,039 GB/s, BF16 312 TFLOPS dense"),
    "h100-sxm": DeviceSpec("H100 SXM 80GB", 3.35e12, 989e12, 80e9,
                           "NVIDIA H100 datasheet: HBM3 3.35 TB/s, BF16 989 TFLOPS dense (1,979 with sparsity)"),
    "h200": DeviceSpec("H200 SXM 141GB", 4.8e12, 989e12, 141e9,
                       "NVIDIA H200 datasheet: HBM3e 4.8 TB/s, 141 GB, BF16 989 TFLOPS dense"),
}


@dataclass(frozen=True)
class ServerSpec:
    """N identical devices; figures per device live in `device`, the server's in the properties."""

    device: DeviceSpec
    num_devices: int = 1

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"a server needs at least one device, got {self.num_devices}")

    @property
    def name(self) -> str:
        return self.device.name if self.num_devices == 1 else f"{self.num_devices} x {self.device.name}"

    @property
    def memory_bytes(self) -> float:
        return self.num_devices * self.device.memory_bytes

    @property
    def ridge_flop_per_byte(self) -> float:
        """F / B of one device (the same for N of them): below it a step is bandwidth-bound."""
        return self.device.flops / self.device.bandwidth_bytes_s


def parse_server(name: str) -> tuple[int, str]:
    """'4xa100-80gb' -> (4, 'a100-80gb'); 'h200' -> (1, 'h200'); 'this-machine' -> (1, 'this-machine').

    N of a DEVICES key, N >= 1; this-machine only alone (its figures are measured, not a datasheet's)."""
    if name in DEVICES or name == THIS_MACHINE:
        return 1, name
    match = re.fullmatch(r"([0-9]+)x(.+)", str(name))
    if match is None or match.group(2) not in DEVICES or int(match.group(1)) < 1:
        raise ValueError(f"unknown device or server {name!r}: write {SERVER_SYNTAX}; devices are "
                         f"{sorted(DEVICES)} (and {THIS_MACHINE!r}, alone)")
    return int(match.group(1)), match.group(2)


def server_spec(name: str, this_machine_spec: DeviceSpec | None = None) -> ServerSpec:
    """The server a name stands for; this-machine needs its measured spec (this_machine())."""
    count, key = parse_server(name)
    if key == THIS_MACHINE:
        if this_machine_spec is None:
            raise ValueError(f"{THIS_MACHINE!r} needs its measured figures: pass this_machine(...) as this_machine_spec")
        return ServerSpec(this_machine_spec, 1)
    return ServerSpec(DEVICES[key], count)

