"""The device an experiment runs on: choosing it, describing it, and reading its memory. Its clock
(a time read after the device's queued work) is ablate.api.clock, the one the engine reads."""
from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from ablate.api import kv


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


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for KV caches (ablate.api.kv.free_memory_bytes: free GPU memory, available RAM),
    read once at a job's start; on a GPU after the allocator hands back the blocks it keeps cached
    (an earlier job of a sweep in this process may have left some)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return kv.free_memory_bytes(device)


def process_rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def describe(device: torch.device) -> dict[str, Any]:
    """What results record about the device (environment.json, the W&B config): its name, the TF32
    settings (they change what an fp32 matmul computes and how fast) and, on a GPU, its provenance.
    The torch and triton versions are in ablate.results.environment's `versions`."""
    info: dict[str, Any] = {"device": str(device), "device_identity": identity(device),
                            "torch_threads": torch.get_num_threads(), "tf32": tf32_settings()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"device_name": props.name, "device_memory_bytes": props.total_memory, "gpu": gpu_provenance(device)}
    else:
        info |= {"device_name": _cpu_name(), "cpu_count": os.cpu_count() or 0, "cpu_matrix_units": cpu_matrix_units()}
    return info


def cpu_matrix_units() -> list[str]:
    """The units this CPU multiplies bf16 matrices on, as torch (oneDNN) sees them: `amx-bf16` (tile
    matrix units), `avx512-bf16` (bf16 dot products in vector registers); empty where bf16 products
    are emulated in fp32 arithmetic (convert, multiply, round), which a bf16 timing would then measure."""
    units = []
    if torch.cpu._is_amx_tile_supported():
        units.append("amx-bf16")
    if torch.cpu._is_avx512_bf16_supported():
        units.append("avx512-bf16")
    return units


def refuse_emulated_dtype(dtype: str, device: torch.device) -> None:
    """A ValueError for model.dtype=bf16 on a CPU without bf16 matrix units, or fp16 on any CPU: the
    products would be emulated, and the run would measure the emulation rather than the model."""
    if device.type != "cpu":
        return
    if dtype == "fp16":
        raise ValueError("model.dtype=fp16 on a CPU: no CPU ablate measures on multiplies fp16 matrices natively "
                         "(its products would be emulated); use model.dtype=fp32, or bf16 on a CPU with AMX or "
                         "AVX512-BF16")
    if dtype == "bf16" and not cpu_matrix_units():
        raise ValueError(f"model.dtype=bf16 on this CPU ({_cpu_name()}): it has neither AMX nor AVX512-BF16, so its "
                         "bf16 products would be emulated in fp32 arithmetic and measure the emulation; use "
                         "model.dtype=fp32 here, or bf16 on a CPU that has one of them")


def huge_pages() -> dict[str, Any]:
    """Whether large CPU tensors sit on transparent huge pages: the kernel's policy, PyTorch's switch
    (set at the CLI's start: ablate/process_env.py) and the bytes of this process on them now (read
    after a run: its weights and caches)."""
    policy = ""
    with contextlib.suppress(OSError):
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        policy = re.search(r"\[(\w+)\]", text).group(1) if "[" in text else text.strip()
    anon = 0
    with contextlib.suppress(OSError, AttributeError):
        anon = int(re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text()).group(1)) * 1024
    return {"policy": policy, "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
            "process_bytes_on_huge_pages": anon}


def identity(device: torch.device) -> str:
    """The device a run measured on, as its run id includes it: `cpu`, or `cuda: <GPU name>` (a CPU
    run must never stand for a GPU run of the same config, nor one GPU model for another)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_properties(device).name}"
    return device.type


def tf32_settings() -> dict[str, Any]:
    """Whether fp32 matmuls and convolutions may run in TF32 (10-bit mantissa) on tensor cores."""
    return {"cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


# nvidia-smi --query-gpu fields -> the names recorded (units: MHz for clocks)
SMI_FIELDS = {"driver_version": "driver_version", "clocks.sm": "sm_clock_mhz", "clocks.mem": "memory_clock_mhz",
              "clocks.max.sm": "max_sm_clock_mhz", "clocks.max.mem": "max_memory_clock_mhz",
              "ecc.mode.current": "ecc_mode", "mig.mode.current": "mig_mode"}


def gpu_provenance(device: torch.device) -> dict[str, Any]:
    """The GPU as a result must name it: model, compute capability, SMs, memory, CUDA and cuDNN
    versions from torch; driver, current and max clocks, ECC and MIG state from nvidia-smi (else
    pynvml). What cannot be read is left out, with the reason under `unavailable`: never an error."""
    props = torch.cuda.get_device_properties(device)
    info: dict[str, Any] = {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                            "sm_count": props.multi_processor_count, "total_memory_bytes": props.total_memory,
                            "cuda_version": torch.version.cuda, "cudnn_version": torch.backends.cudnn.version()}
    uuid = getattr(props, "uuid", None)
    target = f"GPU-{uuid}" if uuid else str(device.index if device.index is not None else torch.cuda.current_device())
    try:
        return info | _nvidia_smi(target)
    except Exception as err:  # noqa: BLE001  (no nvidia-smi, or it cannot answer: try NVML)
        smi_error = f"nvidia-smi: {type(err).__name__}: {err}"
    try:
        return info | _nvml(str(uuid) if uuid else None, int(target) if target.isdigit() else 0)
    except Exception as err:  # noqa: BLE001
        return info | {"unavailable": f"{smi_error}; pynvml: {type(err).__name__}: {err}"}


def _nvidia_smi(target: str) -> dict[str, Any]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
                          "-i", target], capture_output=True, text=True, timeout=10, check=True).stdout
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")]
    if len(values) != len(SMI_FIELDS):
        raise ValueError(f"expected {len(SMI_FIELDS)} fields, got {out.strip()!r}")
    return {name: _number(v) for name, v in zip(SMI_FIELDS.values(), values)}


def _number(value: str) -> Any:
    """nvidia-smi's text: a number when it is one, None for [N/A] or [Not Supported]."""
    if value.startswith("["):
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _nvml(uuid: str | None, index: int) -> dict[str, Any]:
    import pynvml   # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid else pynvml.nvmlDeviceGetHandleByIndex(index))
        sm, mem = pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM
        info = {"driver_version": pynvml.nvmlSystemGetDriverVersion(),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, sm),
                "memory_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, mem),
                "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, sm),
                "max_memory_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, mem)}
        for key, read in (("ecc_mode", pynvml.nvmlDeviceGetEccMode), ("mig_mode", pynvml.nvmlDeviceGetMigMode)):
            try:
                info[key] = "Enabled" if read(handle)[0] else "Disabled"    # (current, pending)
            except pynvml.NVMLError:
                info[key] = None                                            # not supported on this GPU
        return info
    finally:
        pynvml.nvmlShutdown()


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


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second on the CPU, the most a decode step can stream its weights at: a sum over
    a filled buffer far larger than any cache, median of `repeats` after one warm-up."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device="cpu")
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times)
