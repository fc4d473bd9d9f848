"""The environment variables ablate's CLI sets at its start, before torch and numpy load, and why;
each run records them in environment.json (`process_env`).

`import ablate` sets none of them: a program that imports ablate keeps its environment as it was,
and gets these settings only by calling apply() before it imports torch or numpy (the CLI does,
ablate/cli.py; benchmarks/decode_profile.py too). What the environment already sets wins.

- THP_MEM_ALLOC_ENABLE=1: CPU tensors of 2 MB and more (weights, KV caches) on transparent huge
  pages. A decode step streams every weight once, and huge pages spare it the TLB misses of 4 KB
  pages (docs/cpu-products.md). PyTorch's allocator reads the variable once, at its first CPU
  allocation. THP_MEM_ALLOC_ENABLE=0 in the environment keeps 4 KB pages.
- OPENBLAS_THREAD_TIMEOUT=20: numpy's OpenBLAS workers spin 2^28 clock ticks (~0.1 s) after each
  call before they sleep, and torch's next parallel step ran 3x slower on the cores they held. 2^20
  ticks (under a millisecond) still spans the gaps between the products of a step lent to numpy's BLAS
  (ablate/model/numpy_blas.py). OpenBLAS reads it when numpy loads: where numpy loaded first, its
  workers spin unbounded, and numpy's BLAS is offered to the products on one thread only (where no
  worker spins).
"""
from __future__ import annotations

import os
import sys
from typing import Any

SETTINGS = {"THP_MEM_ALLOC_ENABLE": "1", "OPENBLAS_THREAD_TIMEOUT": "20"}
_applied: dict[str, Any] | None = None      # what apply() found and did, once it ran


def apply() -> dict[str, Any]:
    """Set each of SETTINGS that the environment does not set; what holds after (record())."""
    global _applied
    numpy_loaded = "numpy" in sys.modules
    set_here = [name for name in SETTINGS if name not in os.environ]
    for name in set_here:
        os.environ[name] = SETTINGS[name]
    _applied = {"set_by_ablate": set_here, "numpy_loaded_before": numpy_loaded}
    return record()


def numpy_spin_bounded() -> bool:
    """Whether numpy's BLAS workers stop spinning within OPENBLAS_THREAD_TIMEOUT: it was in the
    environment when numpy loaded. Known where apply() ran; elsewhere a value in the environment is
    taken to have been there from the process's start."""
    if "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
        return False
    if _applied is None or "OPENBLAS_THREAD_TIMEOUT" not in _applied["set_by_ablate"]:
        return True
    return not _applied["numpy_loaded_before"]


def record() -> dict[str, Any]:
    """For the results: each variable's value (None: unset), those ablate set, whether apply() ran at
    the start, and whether numpy's BLAS workers' spinning is bounded."""
    return {**{name: os.environ.get(name) for name in SETTINGS},
            "set_by_ablate": list(_applied["set_by_ablate"]) if _applied else [],
            "applied_at_start": _applied is not None, "numpy_spin_bounded": numpy_spin_bounded()}
