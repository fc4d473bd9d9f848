"""How many compiled variants of this package's Triton kernels exist in the process.

Triton compiles a @triton.jit kernel once per distinct set of constexpr values, argument dtypes and
integer / pointer specialisations (divisibility by 16, == 1), and keeps each compiled binary in the
JITFunction's in-memory cache. A count that grows during a timed measurement means a compile landed
inside it; a bounded count means launch shapes that change with the batch (split counts, strides) do
not multiply the variants.
"""

from __future__ import annotations

from .decode_attention import _flash_decode_kernel
from .flash_attention import _flash_varlen_fwd_kernel
from .online_softmax import _INTERPRETED, _combine_splits_kernel
from .paged_attention import _paged_decode_kernel

KERNELS = (_flash_varlen_fwd_kernel, _flash_decode_kernel, _paged_decode_kernel, _combine_splits_kernel)


def _cache_entries(kernel) -> int:
    """Compiled binaries held by one JITFunction, across devices.

    Triton >= 3.2 (3.4 to 3.9 included): kernel.device_caches, {device: (kernel_cache, ...)} whose first
    element is the {specialisation key: compiled kernel} dict (the tuple's length varies by version).
    Older Triton: kernel.cache, {device: {key: compiled kernel}}.
    """
    device_caches = getattr(kernel, "device_caches", None)
    if isinstance(device_caches, dict):
        total = 0
        for entry in list(device_caches.values()):  # .values(): never create entries in the defaultdict
            cache = entry[0] if isinstance(entry, tuple) and entry else entry
            total += len(cache) if isinstance(cache, dict) else 0
        return total
    cache = getattr(kernel, "cache", None)
    if isinstance(cache, dict):
        return sum(len(per_device) for per_device in cache.values() if isinstance(per_device, dict))
    return 0


def compiled_variants() -> int:
    """How many compiled kernel variants of ablate_kernels exist in this process (all devices).

    Under TRITON_INTERPRET nothing is compiled (the interpreter runs the Python source with numpy), so
    this is 0 there. The autotuned prefill compiles one variant per candidate config it times.
    """
    if _INTERPRETED:
        return 0
    return sum(_cache_entries(kernel) for kernel in KERNELS)
