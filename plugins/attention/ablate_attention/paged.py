"""attention=paged: decode attention that reads K/V through block tables, with a Triton kernel.

Decode steps (one query per sequence) call ablate_kernels.paged_decode_attention, which walks each
sequence's block table inside the kernel, where Triton can run (a CUDA GPU, or the CPU under
TRITON_INTERPRET=1). Elsewhere, and for steps that feed more than one token (prefill, chunks),
the PyTorch path gathers every sequence's blocks through its table into (B, S, H_kv, D) and runs
SDPA under the causal mask. The backend that ran is recorded per kind of step; falling back to
PyTorch for decode is said once, never silent.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ablate.api import (Attention, KVView, PagedKV, PluginConfig, Requirement, Slot, Stat, StepInputs, causal_mask,
                        pad_queries, unpad_queries)

BACKENDS = ("auto", "triton", "torch")
_warned_devices: set[str] = set()   # warn once per device type per process, not once per arm


@dataclass
class PagedAttentionConfig(PluginConfig):
    name: str = "paged"
    # auto: the Triton kernel for decode steps where it can run, else the PyTorch gather (warned once);
    # triton: refuse to build where it cannot run; torch: always the PyTorch gather
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention.backend must be one of {BACKENDS}, got {self.backend!r}")


def gathered_attention(q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
    """The PyTorch path: gather K/V through the block tables, then masked SDPA. q (T, H, D) -> (T, H, D)."""
    k, v = view.padded(step)                                   # (B, S, H_kv, D): k_cache[block_tables] flattened
    qp = pad_queries(q, step).transpose(1, 2)                  # (B, H, Lq, D)
    mask = causal_mask(step)[:, None]                          # (B, 1, Lq, S): key j <= query position, j < context
    out = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    return unpad_queries(out.transpose(1, 2), step)            # (T, H, D)


class PagedAttention(Attention):
    name = "paged"
    config_class = PagedAttentionConfig
    requires = (Requirement(Slot.KV_CACHE, frozenset({"paged"}), "reads K/V through block tables"),)
    reported_stats = (Stat("backends", "the implementation that ran, per kind of step", "text", "first"),)

    def __init__(self, config: PagedAttentionConfig, ctx) -> None:
        super().__init__(config, ctx)
        import ablate_kernels  # imported here: TRITON_INTERPRET must be set before triton is imported

        self._kernel = ablate_kernels.paged_decode_attention
        device = ctx.device
        runnable = ablate_kernels.triton_available(device)
        if config.backend == "triton" and not runnable:
            raise RuntimeError(f"attention=paged backend=triton: the Triton kernel cannot run on {device} "
                               "(it needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported); "
                               "use attention.backend=auto or torch")
        self.use_triton = runnable and config.backend != "torch"
        if config.backend == "auto" and not runnable and device.type not in _warned_devices:
            _warned_devices.add(device.type)
            warnings.warn(f"attention=paged: the Triton paged-decode kernel cannot run on {device} (it needs a CUDA "
                          "GPU, or TRITON_INTERPRET=1 before triton is imported); decode steps use the PyTorch "
                          "block-table gather instead, recorded as backend 'torch'", stacklevel=2)
        self.backends: dict[str, str] = {}    # kind of step (decode, prefill) -> implementation that ran

    @property
    def backend(self) -> str:
        ran = ",".join(f"{kind}={impl}" for kind, impl in sorted(self.backends.items()))
        return f"paged({ran})" if ran else "paged"

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        if not isinstance(view, PagedKV):
            # K/V the model built from the cached rows itself (MLA's explicit path up-projects its
            # latents into padded K and V): no block tables to walk, the generic path reads them
            self.backends.setdefault("unpaged", "torch")
            return gathered_attention(q, view, step)
        if step.is_decode and self.use_triton:
            self.backends["decode"] = "triton"
            # q (B, H, D): one query per sequence; keys of sequence b at block_tables[b, p // bs], p % bs
            return self._kernel(q, view.k_cache, view.v_cache, view.block_tables, step.kv_lens_t)
        self.backends.setdefault("decode" if step.is_decode else "prefill", "torch")
        return gathered_attention(q, view, step)

    def stats(self) -> dict[str, str]:
        return {"backends": self.backend}
