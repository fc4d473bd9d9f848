"""Peak memory of a piece of code: the CUDA allocator's figure on a GPU, tracked tensor bytes on the CPU.

On a GPU, torch.cuda.max_memory_allocated is exact, but absolute: it counts every tensor of the
process (other arms' models, what a probe left). One arm's own peak is therefore read as a
difference: the peak statistic reset at the arm's start (it restarts at what is allocated then),
peak - allocated at the start = what the arm added at its most, plus the weights the arm runs on
that were already resident (start_cuda_peak, cuda_peak_since, resident_weight_bytes). The CPU allocator keeps no statistics, and the
process RSS moves in pages, lags frees and includes everything else, so on the CPU we count tensor
storages ourselves: a TorchDispatchMode sees every ATen op called inside the block. A storage that
an op returns and that none of the op's inputs owned was allocated by that op: its bytes are added.
When the storage is freed they are subtracted: PyTorch keeps a storage's Python object alive exactly
as long as the storage itself, so a weakref.finalize on it runs at the free. The peak of the running
sum is the most tensor memory the block held at once on top of what existed before it.

Why not the profiler's memory events (torch.profiler with profile_memory=True), which see every
allocation, scratch inside a kernel included: its timeline of allocations is only reachable through
a private API (kineto_results), it takes seconds to start and prints to stderr, and it records every
op of the process while on. What this tracker misses is exactly that in-kernel scratch, allocated
and freed within one op. For attention that is SDPA's per-thread tiles of (query block x key
block), whose size does not grow with the sequence, so the growth with sequence length (the ch12
figure) is the same either way; the absolute figure can be lower by those tiles.

Views, in-place and out= ops add nothing (their outputs share an input's storage). A storage
resized in place (resize_) keeps the size it had when first seen. Tensors created outside PyTorch's
dispatcher (from numpy, or by Triton's interpreter) are not seen.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_of(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.is_sparse:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):   # tensors without a storage (nested, functional wrappers)
        return None


class TensorMemoryTracker(TorchDispatchMode):
    """with TensorMemoryTracker() as tracker: ...; tracker.peak_bytes -> most bytes of storages
    allocated inside the block that were alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_allocations = 0
        self._live: dict[int, weakref.finalize] = {}      # StorageImpl address -> its finaliser

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {s._cdata for s in map(_storage_of, tree_leaves((args, kwargs))) if s is not None}
        out = func(*args, **kwargs)
        for storage in map(_storage_of, tree_leaves(out)):
            if storage is not None and storage._cdata not in inputs and storage._cdata not in self._live:
                self._allocated(storage)
        return out

    def _allocated(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        self._live[key] = weakref.finalize(storage, self._freed, key, nbytes)
        self.live_bytes += nbytes
        self.num_allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self.live_bytes -= nbytes

    def __exit__(self, *exc) -> None:
        for finaliser in self._live.values():   # storages that outlive the block: stop watching them
            finaliser.detach()
        self._live.clear()
        return super().__exit__(*exc)


@dataclass(frozen=True)
class PeakMemory:
    bytes: int          # most bytes allocated at once during the call, beyond what was allocated before it
    method: str         # cuda-allocator | tensor-tracker


def peak_memory_of(fn: Callable[[], Any], device: torch.device) -> tuple[Any, PeakMemory]:
    """Run fn() once; its result and the peak memory it added: torch.cuda.max_memory_allocated minus
    what was allocated before (GPU), or the tensor tracker above (any other device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, PeakMemory(torch.cuda.max_memory_allocated(device) - before, "cuda-allocator")
    with TensorMemoryTracker() as tracker:
        result = fn()
    return result, PeakMemory(tracker.peak_bytes, "tensor-tracker")


def start_cuda_peak(device: torch.device) -> int:
    """An arm starts on a GPU: the peak statistic restarts at what is allocated now, returned."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak_since(device: torch.device, allocated_before: int) -> int:
    """Most bytes allocated at once since start_cuda_peak, beyond what was allocated then."""
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - allocated_before


def resident_weight_bytes(arm_model: torch.nn.Module, model: torch.nn.Module) -> int:
    """Bytes of `arm_model`'s parameters stored in `model`'s tensors, i.e. allocated before the arm
    started (all of them, unless the arm's variant made new weights: those the difference counts)."""
    resident = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in arm_model.parameters()
               if p.untyped_storage().data_ptr() in resident)
