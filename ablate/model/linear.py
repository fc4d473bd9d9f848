"""nn.Linear whose weight is pre-packed for oneDNN when it runs on the CPU.

PyTorch's CPU `F.linear` hands a (T, d_in) x (d_out, d_in)^T product to MKL, whose small-M path is
slow on AVX2 machines: for the 2-128 tokens of a decode or verify step it runs at about half the
speed of oneDNN on weights reordered once into its blocked layout (measured on SmolLM2's shapes,
2 cores: 4 tokens 127 -> 51 ms, 32 tokens 149 -> 99 ms for the 121 matmuls of one forward; 1 token
55 -> 51 ms, near the memory-bandwidth bound). This is what Inductor's CPU "freezing" does; here it is
done eagerly, without compiling anything.

The packed copy is made on the first CPU forward and remade whenever the weight changes (a new
tensor, or an in-place edit that bumps its version), so model variants that rewrite weights stay
correct. It costs a second copy of each weight in memory; GPU tensors, dtypes oneDNN cannot pack on
this CPU (bf16 without AVX-512 or AVX-NE-CONVERT) and `ABLATE_PACKED_LINEAR=0` use plain F.linear.

One token (a decode step at batch 1) is a matrix-vector product, bound by reading W once. There
oneDNN's blocked layout is no help (and slower with one thread), and MKL's gemv streams W fastest
when each input's row of W^T is contiguous: `input_major()` stores W as the transpose of a
contiguous (d_in, d_out) tensor (the same values, the strides swapped), so F.linear becomes
y = x @ W^T over contiguous memory (55 -> 40 ms for SmolLM2's 121 matmuls on 2 cores). fp32 only:
PyTorch's bf16 products on a CPU without native bf16 are ~10x slower on the transposed layout.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    if os.environ.get("ABLATE_PACKED_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


PACKABLE = _packable_dtypes()


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Changes when the weight does: its storage, and its version counter (inference tensors have none)."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


class Linear(nn.Linear):
    """y = x W^T + b, through a oneDNN-packed W on the CPU (see the module docstring)."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None

    def input_major(self) -> None:
        """Lay W out as W^T contiguous (see the module docstring); values and shape unchanged."""
        if self.weight.is_contiguous():
            with torch.no_grad():
                self.weight.data = self.weight.data.t().contiguous().t()    # (d_out, d_in), strides (1, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _eager_forward is not None and torch.compiler.is_compiling():
            # engine.graphs on a CPU compiles the arithmetic around the products; the products keep
            # the layouts above (Inductor's own CPU products ran this engine's batch-8 decode at half speed)
            return _eager_forward(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        one_row = x.numel() == x.shape[-1]                                # a matrix-vector product
        if one_row or w.device.type != "cpu" or w.dtype not in PACKABLE or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        key = _weight_key(w)
        if key != self._packed_key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)   # blocked
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


# Linear._forward kept out of torch.compile; made on first use (products_stay_eager): importing
# torch._dynamo costs seconds, and imports triton before a test can ask for its interpreter
_eager_forward = None


def products_stay_eager() -> None:
    """Before torch.compile traces a model: its Linear products run eagerly, on the layouts above."""
    global _eager_forward
    if _eager_forward is None:
        _eager_forward = torch.compiler.disable(Linear._forward)
