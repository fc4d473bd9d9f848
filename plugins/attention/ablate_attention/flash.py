"""attention=flash: the Triton FlashAttention kernels of ablate_kernels, with an honest fallback.

Which kernel runs for which step:
- the `none` cache (PackedKV: this step's K/V packed like the queries): flash_attention_varlen with
  cu_seqlens_q = cu_seqlens_k = the step's query starts;
- a decode step (one query per sequence) over padded rows (contiguous, dynamic caches):
  flash_attention_decode straight on the cache rows, kv_lens masking the rest;
- a decode step over paged blocks: paged_decode_attention, the same split-K online softmax reading
  each key through the block table in place (FlashAttention's decode with a block table, as vLLM
  runs it). Both decode paths read lengths and block tables from tensors only, so every decode
  step this plugin runs can be captured into a CUDA graph (graph_safe);
- anything else (prefill chunks after a prefix, paged prefill): the keys are gathered into packed
  (sum of context lengths, H_kv, D) and flash_attention_varlen runs with cu_seqlens_k from the
  context lengths (causal masking is bottom-right aligned, as the engine's positions are).

Where the kernels cannot run, PyTorch's SDPA runs instead, with a warning the first time each reason
occurs in the process, and `backend` says so (it is recorded with every result row):
- no Triton on this device: a CPU without TRITON_INTERPRET=1 (the interpreter, for tests only);
- shapes the kernels do not take: head dims that are not a power of two in 16..256 (MLA's latent
  width 512 + 64, for one), or K and V of different widths.
`backend` is "flash-triton" when every call ran the kernels ("flash-triton-interpreted" under
TRITON_INTERPRET on a CPU: never a timing), "sdpa-fallback(<reason>: <sdpa's
backend>)" when none did, and lists both, per kind of step, when some calls fell back.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ablate.api import (Attention, BuildContext, KVView, PackedKV, PaddedKV, PagedKV, PluginConfig, Stat,
                        StepInputs, device_tensor)
from ablate_attention.sdpa import SDPAAttention, SDPAConfig

_WARNED: set[str] = set()     # fallback reasons already warned about in this process


class FlashFallbackWarning(UserWarning):
    """attention=flash ran PyTorch's SDPA instead of the Triton kernels."""


@dataclass
class FlashConfig(PluginConfig):
    name: str = "flash"


def kernels_module():
    """ablate_kernels, imported on first use: importing triton reads TRITON_INTERPRET once, and the
    plugin registry imports this module long before any attention runs."""
    import ablate_kernels
    return ablate_kernels


def unsupported_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs, or None when they can."""
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two in 16..256"
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return f"K/V widths {k.shape[-1]}/{v.shape[-1]} differ from the query's {head_dim}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not fp16, bf16 or fp32"
    return None


def packed_context_index(step: StepInputs, padded_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flattened (B x padded_len) keys that hold real context, in sequence order, and
    cu_seqlens_k (B+1,) int32: where each sequence's keys start once packed. Built on the host from
    the step's lists: a nonzero() on the device would wait for the GPU."""
    def make():
        device = step.input_ids.device
        rows = [b * padded_len + j for b, n in enumerate(step.kv_lens) for j in range(n)]
        cu = [0]
        for n in step.kv_lens:
            cu.append(cu[-1] + n)
        return device_tensor(rows, torch.long, device), device_tensor(cu, torch.int32, device)
    return step.memo(f"flash_packed_context_{padded_len}", make)


class FlashAttention(Attention):
    name = "flash"
    config_class = FlashConfig
    # decode over rows or blocks reads lengths from kv_lens_t and blocks from the view's table, never
    # the step's lists; only prefill (never captured) gathers by the lists (engine.graphs)
    graph_safe = True
    reported_stats = (Stat("backends", "the implementation that ran, per kind of step", "text", "first"),)

    def __init__(self, config: FlashConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.kernels = kernels_module()
        self.sdpa = SDPAAttention(SDPAConfig(), ctx)
        self.no_triton_reason = None if self.kernels.triton_available(ctx.device) else f"no Triton on {ctx.device.type}"
        self.no_triton_hint = (" (on a CPU the kernels run in Triton's interpreter when TRITON_INTERPRET=1 is set "
                               "before triton is imported: tests only, it is slow)") if ctx.device.type == "cpu" else ""
        self.ran: dict[str, set[str]] = {}     # kind of step -> self.kernel (ran) and/or fallback reasons
        self.kernel = "flash-" + self.kernels.backend_label(ctx.device)   # flash-triton(-interpreted)

    @property
    def backend(self) -> str:
        if not self.ran:
            return self.kernel if self.no_triton_reason is None else f"sdpa-fallback({self.no_triton_reason})"
        outcomes = set().union(*self.ran.values())
        if outcomes == {self.kernel}:
            return self.kernel
        if len(outcomes) == 1:
            return f"sdpa-fallback({outcomes.pop()}: {self.sdpa.backend})"
        parts = [f"{kind}=" + "+".join(o if o == self.kernel else f"sdpa-fallback({o})" for o in sorted(found))
                 for kind, found in sorted(self.ran.items())]
        return f"{', '.join(parts)}; {self.sdpa.backend}"

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        kind = "decode" if step.is_decode else "prefill"
        why = self.no_triton_reason or unsupported_shape(q, *self._kv(view))
        if why is not None:
            self._fell_back(kind, why)
            return self.sdpa(q, view, step)
        self.ran.setdefault(kind, set()).add(self.kernel)
        if isinstance(view, PackedKV):
            return self.kernels.flash_attention_varlen(
                q, view.k, view.v, step.query_starts_t, step.query_starts_t,
                step.max_query_len, step.max_query_len, causal=True)                     # (T, H, D)
        if step.is_decode and isinstance(view, PaddedKV):
            b, h, d = step.num_seqs, q.shape[1], q.shape[2]
            return self.kernels.flash_attention_decode(q.reshape(b, h, d), view.k, view.v,
                                                       step.kv_lens_t)               # (T = B, H, D)
        if step.is_decode and isinstance(view, PagedKV):
            b, h, d = step.num_seqs, q.shape[1], q.shape[2]
            return self.kernels.paged_decode_attention(q.reshape(b, h, d), view.k_cache, view.v_cache,
                                                       view.block_tables, step.kv_lens_t)   # (T = B, H, D)
        k, v = view.padded(step)                                                         # (B, S, H_kv, D)
        rows, cu_seqlens_k = packed_context_index(step, k.shape[1])
        k = k.reshape(-1, *k.shape[2:]).index_select(0, rows)                           # (sum ctx, H_kv, D)
        v = v.reshape(-1, *v.shape[2:]).index_select(0, rows)
        return self.kernels.flash_attention_varlen(
            q, k, v, step.query_starts_t, cu_seqlens_k, step.max_query_len, step.max_kv_len, causal=True)

    @staticmethod
    def _kv(view: KVView) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(view, (PackedKV, PaddedKV)):
            return view.k, view.v
        return view.k_cache, view.v_cache

    def _fell_back(self, kind: str, why: str) -> None:
        self.ran.setdefault(kind, set()).add(why)
        if why not in _WARNED:
            _WARNED.add(why)
            hint = self.no_triton_hint if why == self.no_triton_reason else ""
            warnings.warn(f"attention=flash: {why}{hint}; running PyTorch's scaled_dot_product_attention instead, "
                          "and recording that as the attention backend of the results", FlashFallbackWarning,
                          stacklevel=3)

    def stats(self) -> dict[str, str]:
        return {"backends": self.backend}
