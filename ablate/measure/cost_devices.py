"""The devices a cost calculator's config names (ablate.analysis.costs), this machine among them:
its bandwidth and matmul FLOP/s measured (ablate.measure.hardware.peaks, cached) or given, its RAM as
memory. The datasheet devices and the servers of N of a kind are ablate.analysis.devices'."""
from __future__ import annotations

import psutil
import torch

from ablate.analysis.costs import CostsConfig
from ablate.analysis.devices import THIS_MACHINE, DeviceSpec, ServerSpec, server_spec
from ablate.measure import hardware
from ablate.model.config import DTYPES


def this_machine(dtype: torch.dtype, bandwidth: float = 0.0, flops: float = 0.0) -> DeviceSpec:
    """The CPU this runs on: bandwidth and matmul FLOP/s measured (cached) or given, RAM as memory."""
    peaks = hardware.peaks(torch.device("cpu"), dtype, bandwidth, flops)
    return DeviceSpec("this machine (CPU)", peaks.bandwidth_bytes_s, peaks.flops,
                      float(psutil.virtual_memory().total), f"ablate.measure.hardware.peaks ({peaks.source}); RAM from psutil")


def resolve_devices(config: CostsConfig, bandwidth: float = 0.0, flops: float = 0.0) -> dict[str, ServerSpec]:
    """config.devices -> servers (a single device is a server of one); this-machine measured or given."""
    mine = this_machine(DTYPES[config.dtype], bandwidth, flops) if THIS_MACHINE in config.devices else None
    return {key: server_spec(key, mine) for key in config.devices}
