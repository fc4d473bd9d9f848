"""One-row steps on numpy's BLAS: its thread pool and torch's take turns on the cores.

At one row a product is a matrix-vector product, bound by reading W; numpy's BLAS (OpenBLAS in its
wheels) streams some shapes faster than either of torch's paths (ablate/model/linear.py times all
three). It runs on a thread pool of its own, and two busy pools on the same cores are a disaster:
after each parallel region the idle workers of one spin while the other's need the core (SmolLM2's
decode step took 260 ms instead of 35 on 2 cores). So a step whose products are all one row, when
numpy carries them, lends the cores to numpy: torch's own operations (norms, RoPE, attention over a
few hundred keys) run on the calling thread, and numpy's BLAS on as many threads as torch had. After
such a step numpy's workers must not spin on into torch's next one: ablate/__init__.py bounds their
spinning before numpy loads.
"""
from __future__ import annotations

import contextlib
import os

import torch

import ablate

on_numpy: dict[tuple[torch.dtype, int], bool] = {}   # (dtype, torch threads) -> one-row steps on numpy, timed once
_lent: int | None = None      # torch's threads while a one-row step has lent them to numpy
_blas = None                  # threadpoolctl's handle on numpy's BLAS, made on first use


def lent_threads() -> int | None:
    """torch's thread count outside the one-row step running now, or None outside such a step."""
    return _lent


@contextlib.contextmanager
def torch_threads(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def blas_threads(threads: int) -> bool:
    """numpy's BLAS set to `threads` threads (through threadpoolctl); False where it cannot be (no
    threadpoolctl, or a BLAS it does not know) or should not be: ABLATE_NUMPY_LINEAR=0, or numpy
    loaded before ablate could bound its workers' spinning (ablate/__init__.py), so that every step
    after a one-row step would share the cores with them."""
    global _blas
    if _blas is None and (not ablate.NUMPY_SPIN_BOUNDED or os.environ.get("ABLATE_NUMPY_LINEAR", "1") == "0"):
        _blas = False
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _blas = False
        else:
            _blas = ThreadpoolController().select(user_api="blas") or False
    if not _blas:
        return False
    for lib in _blas.lib_controllers:
        if lib.num_threads != threads:
            lib.set_num_threads(threads)
    return True


@contextlib.contextmanager
def one_row_step(rows: int, weight: torch.Tensor):
    """A step of `rows` product rows through a model holding `weight` (its dtype and device): lent to
    numpy's BLAS when the rows are one and the timing chose numpy for them (see the module docstring)."""
    global _lent
    threads = torch.get_num_threads()
    if rows != 1 or _lent is not None or weight.device.type != "cpu" or not on_numpy.get((weight.dtype, threads)):
        yield
        return
    blas_threads(threads)
    _lent = threads
    try:
        with torch_threads(1):
            yield
    finally:
        _lent = None
