"""The KV memory budget every cache takes: a number of bytes, or a fraction of the free memory.

The fraction is of what is free when the cache is built (after the model's weights are loaded):
free device memory on a GPU (torch.cuda.mem_get_info), available RAM on the CPU (psutil).
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from ablate.api.plugin import PluginConfig


@dataclass
class BudgetConfig(PluginConfig):
    budget_bytes: int = 0          # most bytes of K/V the cache may hold; 0: see budget_fraction
    budget_fraction: float = 0.0   # or this fraction of free device memory (RAM on the CPU); 0: no limit

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"kv_cache.budget_bytes must be >= 0, got {self.budget_bytes}")
        if not 0 <= self.budget_fraction <= 1:
            raise ValueError(f"kv_cache.budget_fraction must be in [0, 1], got {self.budget_fraction}")
        if self.budget_bytes and self.budget_fraction:
            raise ValueError("kv_cache.budget_bytes and kv_cache.budget_fraction are both set: give one")


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def budget_bytes(config: BudgetConfig, device: torch.device) -> int:
    """The budget in bytes; 0: no limit."""
    if config.budget_fraction:
        return int(config.budget_fraction * free_memory_bytes(device))
    return config.budget_bytes
