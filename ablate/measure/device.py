"""The device an experiment runs on: choosing it, timing on it, and reading its memory."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator

import psutil
import torch

from ablate.api.clock import now, synchronize  # noqa: F401  (the engine's clock: re-exported)


def resolve(name: str = "auto") -> torch.device:
    """auto -> cuda when a GPU is present, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ValueError(f"device={name!r} is not a device ablate runs on; use device=auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA GPU is visible; use device=cpu or device=auto")
    return device


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated by tensors on the GPU since the last reset (None on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def process_rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def describe(device: torch.device) -> dict[str, str | int]:
    """What results record about the device."""
    info: dict[str, str | int] = {"device": str(device), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"device_name": props.name, "device_memory_bytes": props.total_memory}
    else:
        info |= {"device_name": _cpu_name(), "cpu_count": os.cpu_count() or 0}
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "cpu"


@contextlib.contextmanager
def exclusive(device: torch.device) -> Iterator[None]:
    """Hold the device alone: jobs launched in parallel (joblib, submitit on one node) that were
    given the same GPU wait for each other instead of sharing it and spoiling each other's timings.
    A no-op on the CPU, where parallel jobs are an explicit choice (hydra.launcher.n_jobs)."""
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    path = os.path.join(tempfile.gettempdir(), f"ablate-cuda{index}.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
