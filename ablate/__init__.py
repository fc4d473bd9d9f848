"""ablate: measure what each LLM-inference technique buys, alone and in combination."""
import os

# CPU tensors of 2 MB and more (weights, KV caches) on transparent huge pages: PyTorch's allocator
# reads this once, at its first allocation, so it is set before anything of ablate allocates. A decode
# step streams every weight once; with 4 KB pages SmolLM2's step ran ~6% slower (benchmarks/decode_profile.py).
# THP_MEM_ALLOC_ENABLE=0 in the environment keeps 4 KB pages; environment.json records which held.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
