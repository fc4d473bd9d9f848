"""The native kernels' library: built from the C sources beside this file, cached, loaded, and what
state it is in.

Built on first use with the machine's C compiler (`CC`, default cc): -O3 -march=native for this
CPU's vector units, -fopenmp for threads, every source into one library. The library is cached under
ABLATE_CACHE_DIR (default ~/.cache/ablate) keyed by the sources, the compiler and the CPU, so a
machine of another kind builds its own. No compiler, or a build that fails: `available()` is False,
the reason is in `unavailable_reason()`, and every caller takes one of torch's paths.

A cached library is loaded only when its bytes are those it was built with: its file name ends in the
first 16 hex digits of their sha256. Loading an emptied one would fail (and turn the kernels off for
good) and loading a truncated one maps pages past its end (SIGBUS at the first call), so a damaged
one is rebuilt in its place; a damaged one that cannot be rebuilt is a one-line warning. Every build
is written aside and renamed into the cache, so no process sees half a file.

The library is loaded after torch, so its OpenMP runtime is the one torch loaded (the soname
libgomp.so.1 is loaded once per process): its parallel regions share torch's thread pool.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "steps.c", HERE / "paged_attention.c", HERE / "layers.c")   # compiled, in this order, into one library
HEADERS = (HERE / "vectors.h",)                              # included by them: part of the cache key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DIGEST_CHARS = 16                 # a cached library's name ends in this many hex digits of its sha256
_p, _i64 = ctypes.c_void_p, ctypes.c_long
# each kernel's C signature: (argument types, return type)
SIGNATURES = {
    "matvec": ([_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int], None),
    "matvec_bf16": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int], None),
    "rms_norm": ([_p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int], None),
    "rms_norm_bf16": ([_p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int], None),
    "rope": ([_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int], None),
    "silu_mul": ([_p, _p, _i64, _i64, ctypes.c_int], None),
    "paged_decode_attention": ([_p] * 6 + [_i64] * 6 + [ctypes.c_float, ctypes.c_int], None),
    "layer_qkv": ([_p, _p, ctypes.c_float] + [_p] * 8 + [_i64] * 5 + [ctypes.c_int], None),
    "layer_out_mlp": ([_p, _p, _p, _p, ctypes.c_float] + [_p] * 4 + [_i64] * 4 + [ctypes.c_int], None),
    "layer_paged_decode": ([_p, _p, ctypes.c_float] + [_p] * 9 + [_i64, _i64, ctypes.c_float, _p, _p, ctypes.c_float]
                           + [_p] * 4 + [_i64] * 6 + [ctypes.c_int], None),
    "vector_floats": ([], ctypes.c_int),
}


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
        result = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip().splitlines()[-1:]}")
        target = cache / f"native-{key}-{_sha256(built)[:DIGEST_CHARS]}.so"
        os.replace(built, target)
    return target


def _build(cc: str) -> Path:
    """The compiled library: an intact one from the cache, else built now (a damaged one rebuilt)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f"{p.name}\0{p.read_text()}" for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join((*texts, cc, version, " ".join(FLAGS), _cpu_signature()))
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
                           f"delete it and check that {cc!r} compiles {', '.join(p.name for p in SOURCES)}") from err
    for path in damaged:       # the rebuild replaced it when its name was the rebuild's; else it is litter
        if path != target and _damage(path) is not None:
            path.unlink(missing_ok=True)
    return target


class NativeLibrary:
    """The kernels' library in this process: loaded on first use (built if need be), or the reason it
    cannot be. One per process (LIBRARY); the product paths report its state (ablate/model/product_paths.py)."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None        # why the kernels are unavailable, once known

    def load(self) -> ctypes.CDLL | None:
        """The loaded kernels, built on first call; None where they cannot be (self.reason says why)."""
        if self.lib is None and self.reason is None:
            cc = os.environ.get("CC", "cc")
            try:
                lib = ctypes.CDLL(str(_build(cc)))
            except DamagedCache as exc:        # the kernels worked here before: turning them off is news
                self.reason = str(exc)
                warnings.warn(f"ablate: {exc}; the native kernels are off", stacklevel=3)
                return None
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                self.reason = f"could not build {', '.join(p.name for p in SOURCES)} with {cc!r}: {exc}"
                return None
            for name, (argtypes, restype) in SIGNATURES.items():
                getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
            self.lib = lib
        return self.lib

    def state(self) -> str:
        """For the results, without building anything: "built, 8-float vectors" (the width it was compiled
        to), why the kernels are unavailable, or "not asked for" (nothing has needed them in this process)."""
        if self.lib is not None:
            return f"built, {self.lib.vector_floats()}-float vectors"
        return self.reason or "not asked for"

    def forget(self) -> None:
        """As in a fresh process: the next use loads the library again (building it if need be)."""
        self.lib = self.reason = None

    @contextlib.contextmanager
    def fresh(self):
        """Inside the block the library is loaded afresh on first use; the state before comes back after."""
        with self._kept(None, None):
            yield

    @contextlib.contextmanager
    def switched_off(self, reason: str):
        """Inside the block the kernels are unavailable, `reason` saying why (every caller takes torch's
        paths, as where they cannot be built); the state before comes back after."""
        with self._kept(None, reason):
            yield

    @contextlib.contextmanager
    def _kept(self, lib: ctypes.CDLL | None, reason: str | None):
        saved = self.lib, self.reason
        self.lib, self.reason = lib, reason
        try:
            yield
        finally:
            self.lib, self.reason = saved


LIBRARY = NativeLibrary()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None where they cannot be (unavailable_reason())."""
    return LIBRARY.load()


def available() -> bool:
    """Whether the kernels are built and loaded (built now, on the first call)."""
    return LIBRARY.load() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (no compiler, a failed build, switched off), or None."""
    LIBRARY.load()
    return LIBRARY.reason


def state() -> str:
    """LIBRARY.state(): "built, N-float vectors", why the kernels are unavailable, or "not asked for";
    builds nothing."""
    return LIBRARY.state()
