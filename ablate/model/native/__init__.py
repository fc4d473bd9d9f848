"""ablate's own CPU kernels, in C compiled here, grouped by concern:

- steps.c / steps.py: a matrix-vector product (one of the paths a product of a few rows can take:
  ablate/model/linear.py times it against the others), and RMSNorm, RoPE and SwiGLU's activation in
  one pass each;
- paged_attention.c / attention.py: decode attention reading a paged KV cache's blocks in place
  (attention=paged through ablate.api.native);
- vectors.h: the vector helpers both share;
- build.py: one library built from them on first use with the machine's C compiler (-O3
  -march=native -fopenmp), cached by content and loaded only when intact, and its state in this
  process (LIBRARY: built, not asked for, or why it is unavailable).

Their tests: tests/test_native.py.
"""
from ablate.model.native.attention import MAX_TASK_FLOATS, paged_decode_attention, paged_decode_problem
from ablate.model.native.build import LIBRARY, DamagedCache, available, library, state, unavailable_reason
from ablate.model.native.steps import (BF16_ROWS, MATVEC_DTYPES, NORM_DTYPES, SMALL_ROWS, matvec, rms_norm, rope,
                                      silu_mul, takes)

__all__ = ["BF16_ROWS", "LIBRARY", "MATVEC_DTYPES", "MAX_TASK_FLOATS", "NORM_DTYPES", "SMALL_ROWS", "DamagedCache", "available", "library", "matvec",
           "paged_decode_attention", "paged_decode_problem", "rms_norm", "rope", "silu_mul", "state", "takes",
           "unavailable_reason"]
