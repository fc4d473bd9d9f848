"""ablate's own CPU kernels (native.c): a matrix-vector product, RMSNorm and paged decode
attention, compiled here.

Why: at one row a product reads each weight once, so a decode step at batch 1 runs at the speed its
weights stream from memory. In SmolLM2's decode step on a Zen 4 EPYC (2 threads, 35 GB/s read
bandwidth; benchmarks/decode_profile.py) oneDNN streamed the products' 538 MB at 22 GB/s and numpy's
OpenBLAS at 23, while this kernel, which reads W packed so that each thread's band is one sequential
stream, reached 31. It is one more path that ablate/model/linear.py times against the others, not a
replacement.
And torch's RMSNorm on a CPU is six operations; for a few rows their dispatch is the whole cost.
Decode attention over a paged cache (attention=paged, through ablate.api.native) reads each block
where it lies, where the PyTorch path gathers every sequence's blocks into padded K/V first and then
runs one SDPA call over many one-query heads.

Built on first use with the machine's C compiler (`CC`, default cc): -O3 -march=native for this
CPU's vector units, -fopenmp for threads. The library is cached under ABLATE_CACHE_DIR (default
~/.cache/ablate) keyed by the source, the compiler and the CPU, so a machine of another kind builds
its own. No compiler, or a build that fails: `available()` is False, the reason is in
`unavailable_reason()`, and every product takes one of torch's paths. ABLATE_NATIVE=0 switches the
kernels off.

A cached library is loaded only when its bytes are those it was built with: its file name ends in the
first 16 hex digits of their sha256. Loading an emptied one would fail (and turn the kernels off for
good) and loading a truncated one maps pages past its end (SIGBUS at the first call), so a damaged
one is rebuilt in its place; a damaged one that cannot be rebuilt is a one-line warning. Every build
is written aside and renamed into the cache, so no process sees half a file.

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
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# RMSNorm, RoPE and SwiGLU's activation take the native kernels up to this many tokens (a decode
# batch, a verify pass): there torch's cost is its operations' dispatch (six for RMSNorm, six for RoPE,
# three for the activation), each against caches the weights just evicted; past it, torch's threads
# are worth their start-up
SMALL_ROWS = 16
# paged_decode_attention keeps a task's running outputs (query heads x D) and one block's scores in
# arrays on its thread's stack: bounded so that they fit any thread's stack with room to spare
MAX_TASK_FLOATS = 32768
DIGEST_CHARS = 16                 # a cached library's name ends in this many hex digits of its sha256
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


class DamagedCache(RuntimeError):
    """The cached library's bytes are not those it was built with, and it could not be rebuilt."""


def _cache_dir() -> Path:
    return Path(os.environ.get("ABLATE_CACHE_DIR") or Path.home() / ".cache" / "ablate")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _damage(path: Path) -> str | None:
    """What is wrong with cached library `path` (named native-<key>-<sha256 prefix>.so), or None."""
    recorded = path.stem.rpartition("-")[2]
    if len(recorded) != DIGEST_CHARS:
        return "not named by its digest"
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty"
        if _sha256(path)[:DIGEST_CHARS] != recorded:
            return f"{size} bytes whose sha256 is not the one it was built with (truncated or overwritten)"
    except OSError as err:
        return f"unreadable ({err.strerror})"
    return None


def _compile(cc: str, cache: Path, key: str) -> Path:
    """Build the library aside, then rename it into the cache under its content's digest: a reader
    (another process included) sees no file or a whole one."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / f"native-{key}.so"
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip().splitlines()[-1:]}")
        target = cache / f"native-{key}-{_sha256(built)[:DIGEST_CHARS]}.so"
        os.replace(built, target)
    return target


def _build(cc: str) -> Path:
    """The compiled library: an intact one from the cache, else built now (a damaged one rebuilt)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), cc, version, " ".join(FLAGS), _cpu_signature()))
                         .encode()).hexdigest()[:16]
    cache = _cache_dir()
    damaged = {}
    for cached in sorted(cache.glob(f"native-{key}-*.so")):
        damage = _damage(cached)
        if damage is None:
            return cached
        damaged[cached] = damage
    try:
        target = _compile(cc, cache, key)
    except (OSError, RuntimeError) as err:
        if not damaged:
            raise
        path, damage = next(iter(damaged.items()))
        raise DamagedCache(f"the cached native library {path} is {damage}, and rebuilding it failed: {err}; "
                           f"delete it and check that {cc!r} compiles {SOURCE.name}") from err
    for path in damaged:       # the rebuild replaced it when its name was the rebuild's; else it is litter
        if path != target and _damage(path) is not None:
            path.unlink(missing_ok=True)
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
        except DamagedCache as exc:        # the kernels worked here before: turning them off is news
            _reason = str(exc)
            warnings.warn(f"ablate: {exc}; the native kernels are off", stacklevel=2)
            return None
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            _reason = f"could not build {SOURCE.name} with {cc!r}: {exc}"
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_long
        lib.matvec.argtypes = [p, p, p, p, i64, i64, ctypes.c_int]
        lib.matvec.restype = None
        lib.rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float]
        lib.rms_norm.restype = None
        lib.rope.argtypes = [p, p, p, p, i64, i64, i64]
        lib.rope.restype = None
        lib.silu_mul.argtypes = [p, p, i64, i64]
        lib.silu_mul.restype = None
        lib.paged_decode_attention.argtypes = [p] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
        lib.paged_decode_attention.restype = None
        _lib = lib
    return _lib


def state() -> str:
    """For the results, without building anything: "built", why the kernels are unavailable, or
    "not asked for" (no CPU step has needed them in this process)."""
    return "built" if _lib is not None else _reason or "not asked for"


def available() -> bool:
    """Whether the kernels are built and loaded (built now, on the first call)."""
    return library() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (no compiler, a failed build, switched off), or None."""
    library()
    return _reason


def takes(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels (rms_norm, rope, silu_mul) take x, tokens first: fp32 on the
    CPU, at most SMALL_ROWS tokens, outside torch.compile (which cannot trace a ctypes call), built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] <= SMALL_ROWS
            and not torch.compiler.is_compiling() and available())


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """W (d_out, d_in) in matvec's layout (native.c): (ceil(d_out / 8), ceil(d_in / 16), 8, 16), each
    block of 8 rows stored 16 columns at a time, zeros past d_out and d_in."""
    d_out, d_in = w.shape
    padded = F.pad(w.detach(), (0, -d_in % 16, 0, -d_out % 8))                 # (d_out', d_in')
    return padded.view(padded.shape[0] // 8, 8, padded.shape[1] // 16, 16).transpose(1, 2).contiguous()


def matvec(packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, d_out: int, threads: int) -> torch.Tensor:
    """x W^T + b for one row x (..., d_in), W fp32 on the CPU packed by pack_rows -> (..., d_out)."""
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], d_out, dtype=x.dtype, device=x.device)
    library().matvec(packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     d_out, x.shape[-1], threads)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension: fp32 CPU tensors, weight contiguous."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, 1, D), rotate-half layout (ablate/model/rope.py) -> (T, H, D)."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    library().rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), *x.shape)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (T, 2F) = [gate | up] -> (T, F)."""
    gate_up = gate_up.contiguous()
    rows, f = gate_up.shape[0], gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], f, dtype=gate_up.dtype, device=gate_up.device)
    library().silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, f)
    return y


def paged_decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why paged_decode_attention cannot take these tensors, or None: q (B, H, D), caches
    (num_blocks, block_size, H_kv, D)."""
    if not available():
        return f"no native kernels ({unavailable_reason()})"
    if {q.device.type, k_cache.device.type, v_cache.device.type} != {"cpu"}:
        return "the native kernel runs on the CPU only"
    if {q.dtype, k_cache.dtype, v_cache.dtype} != {torch.float32}:
        return f"the native kernel takes fp32 only, got q {q.dtype} and a {k_cache.dtype} cache"
    if k_cache.shape != v_cache.shape or q.shape[-1] != k_cache.shape[-1]:
        return (f"the native kernel needs K and V of one width, that of the queries: q {tuple(q.shape)}, "
                f"K {tuple(k_cache.shape)}, V {tuple(v_cache.shape)}")
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        return f"{heads} query heads do not divide into {kv_heads} KV heads"
    if heads * q.shape[-1] + k_cache.shape[1] > MAX_TASK_FLOATS:
        return (f"{heads} query heads x D={q.shape[-1]} plus blocks of {k_cache.shape[1]} exceed the kernel's "
                f"{MAX_TASK_FLOATS} floats a task")
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, threads: int, sm_scale: float | None = None) -> torch.Tensor:
    """One query per sequence over its blocks, read in place -> (B, H, D). q (B, H, D) fp32; caches
    (num_blocks, block_size, H_kv, D) fp32; block_tables (B, max_blocks) and context_lens (B) int32.
    The caller has checked paged_decode_problem()."""
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    scale = dim ** -0.5 if sm_scale is None else sm_scale
    library().paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                     lens.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[2], dim,
                                     k_cache.shape[1], tables.shape[1], scale, threads)
    return out
