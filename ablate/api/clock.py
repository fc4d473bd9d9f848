"""Timing inside a plugin (a drafter's share of a step, say): a clock read after the device's
queued work is done, so that it measures that work."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that a clock read after it measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Seconds (perf_counter) once `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
