"""ablate's own CPU kernels (native.c): a matrix-vector product and RMSNorm, compiled here.

Why: at one row a product reads each weight once, so a decode step at batch 1 runs at the speed its
weights stream from memory. On a Zen 4 EPYC (2 threads, 33 GB/s read bandwidth) MKL's matrix-vector
path streamed SmolLM2's 121 products at 16 GB/s, oneDNN's at 21 and numpy's OpenBLAS at 22, while a
plain loop that reads each thread's band of rows front to back and prefetches a block ahead reached
26-30. It is one more path that ablate/model/linear.py times against the others, not a replacement.
And torch's RMSNorm on a CPU is six operations; for a few rows their dispatch is the whole cost.

Built on first use with the machine's C compiler (`CC`, default cc): -O3 -march=native for this
CPU's vector units, -fopenmp for threads. The library is cached under ABLATE_CACHE_DIR (default
~/.cache/ablate) keyed by the source, the compiler and the CPU, so a machine of another kind builds
its own. No compiler, or a build that fails: `available()` is False, the reason is in
`unavailable_reason()`, and every product takes one of torch's paths. ABLATE_NATIVE=0 switches the
kernels off.

The library is loaded after torch, so its OpenMP runtime is the one torch loaded (the soname
libgomp.so.1 is loaded once per process): its parallel regions share torch's thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# RMSNorm takes the native kernel up to this many rows (a decode batch, a verify pass): there torch's
# cost is its six operations' dispatch; past it, its threads are worth their start-up
NORM_ROWS = 16
_lib: ctypes.CDLL | None = None
_reason: str | None = None        # why the kernels are unavailable, once known


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and its instruction-set flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build(cc: str) -> Path:
    """The compiled library, built now unless the cache holds it."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), cc, version, " ".join(FLAGS), _cpu_signature()))
                         .encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ABLATE_CACHE_DIR") or Path.home() / ".cache" / "ablate")
    target = cache / f"native-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:    # built aside, then moved: atomic
            built = Path(tmp) / target.name
            result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{cc} failed: {result.stderr.strip().splitlines()[-1:]}")
            os.replace(built, target)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None where they cannot be (unavailable_reason())."""
    global _lib, _reason
    if _lib is None and _reason is None:
        if os.environ.get("ABLATE_NATIVE", "1") == "0":
            _reason = "switched off (ABLATE_NATIVE=0)"
            return None
        cc = os.environ.get("CC", "cc")
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            _reason = f"could not build {SOURCE.name} with {cc!r}: {exc}"
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_long
        lib.matvec.argtypes = [p, p, p, p, i64, i64, ctypes.c_int]
        lib.matvec.restype = None
        lib.rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float]
        lib.rms_norm.restype = None
        _lib = lib
    return _lib


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return _reason


def matvec(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    """x W^T + b for one row x (..., d_in) and a row-major fp32 W (d_out, d_in) on the CPU -> (..., d_out)."""
    d_out, d_in = w.shape
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], d_out, dtype=w.dtype, device=w.device)
    library().matvec(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     d_out, d_in, threads)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension: fp32 CPU tensors, weight contiguous."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y
