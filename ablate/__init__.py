"""ablate: measure what each LLM-inference technique buys, alone and in combination."""
import os
import sys

# CPU tensors of 2 MB and more (weights, KV caches) on transparent huge pages: PyTorch's allocator
# reads this once, at its first allocation, so it is set before anything of ablate allocates. A decode
# step streams every weight once: SmolLM2's decode steps (decode_profile.decode_steps) took 35.9 ms with
# 4 KB pages against 33.7 ms on huge pages, one process each.
# THP_MEM_ALLOC_ENABLE=0 in the environment keeps 4 KB pages; environment.json records which held.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# numpy's OpenBLAS workers spin 2^28 clock ticks (~0.1 s) after each call before they sleep: torch's
# next parallel step then ran 3x slower on cores they held. 2^20 ticks (under a millisecond) still
# spans the gaps between the products of one step (ablate/model/numpy_blas.py). OpenBLAS reads it
# when numpy loads; numpy_blas offers its path only where it was set before that.
NUMPY_SPIN_BOUNDED = "OPENBLAS_THREAD_TIMEOUT" in os.environ or "numpy" not in sys.modules
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
