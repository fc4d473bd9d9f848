"""numpy's BLAS as a path for one-row products: its thread pool bound to torch's thread count, and why
it may not be offered.

At one row a product is a matrix-vector product, bound by reading W; numpy's BLAS (OpenBLAS in its
wheels) streams some shapes faster than torch's paths (ablate/model/linear.py times them). It runs on
a thread pool of its own, and two busy pools on the same cores are a disaster: after each parallel
region the idle workers of one spin while the other's need the core. So a step whose products are all
one row, when numpy carries them, lends the cores to numpy (ProductPaths.one_row_step,
ablate/model/product_paths.py): torch's own operations (norms, RoPE, attention over a few hundred
keys) run on the calling thread, and numpy's BLAS on as many threads as torch had. After such a step
numpy's workers must not spin on into torch's next one: the CLI bounds their spinning before numpy
loads (ablate/process_env.py); where nothing did, numpy's BLAS takes products on one thread only,
where no worker spins.
"""
from __future__ import annotations

import contextlib

import torch

from ablate import process_env

_blas = None                  # threadpoolctl's handle on numpy's BLAS, made on first use (False: none)


@contextlib.contextmanager
def torch_threads(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _controller():
    """threadpoolctl's controller of numpy's BLAS, or False (no threadpoolctl, or a BLAS it does not know)."""
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _blas = False
        else:
            _blas = ThreadpoolController().select(user_api="blas") or False
    return _blas


def unavailable_reason(threads: int) -> str | None:
    """Why numpy's BLAS cannot take one-row steps at `threads` threads, or None."""
    if threads > 1 and not process_env.numpy_spin_bounded():
        return ("numpy's BLAS workers spin unbounded (numpy loaded before OPENBLAS_THREAD_TIMEOUT was set: "
                "ablate/process_env.py), and would take the cores from torch's next steps")
    if not _controller():
        return "numpy's threads cannot be set to torch's: no threadpoolctl, or a BLAS it does not know"
    return None


def blas_threads(threads: int) -> bool:
    """numpy's BLAS set to `threads` threads (through threadpoolctl); False where it cannot be or should
    not be (unavailable_reason)."""
    if unavailable_reason(threads) is not None:
        return False
    for lib in _blas.lib_controllers:
        if lib.num_threads != threads:
            lib.set_num_threads(threads)
    return True
