"""Triton attention kernels for ablate: varlen flash attention, padded decode and paged decode.

    flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=True, sm_scale=None)                       -> (T_q, H, D)
    flash_attention_decode(q, k, v, context_lens, sm_scale=None)             -> (B, H, D)
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                           sm_scale=None)                                     -> (B, H, D)
    triton_available(device)                                                  -> bool
    backend_label(device)          -> "triton" | "triton-interpreted" | "unavailable"
    compiled_variants()            -> int, compiled kernel variants in this process (0 when interpreted)

The pure-PyTorch references (same signatures, suffix `_ref`) live in ablate_kernels.reference and
are the fallback where triton_available(device) is False. To run the kernels on CPU (tests only),
set TRITON_INTERPRET=1 before importing triton or this package; label such results with
backend_label(device) ("triton-interpreted"), never as Triton timings.

The decode kernels (flash_attention_decode, paged_decode_attention) can be captured into a CUDA graph:
their host side depends on tensor shapes only, never on values (see decode_attention.py). The prefill
kernel picks its tile config by timing, once per head dim / dtype / length bucket (see tuning.py).
"""

from __future__ import annotations

import importlib.util

from .reference import flash_attention_decode_ref, flash_attention_varlen_ref, paged_decode_attention_ref

__all__ = [
    "flash_attention_varlen",
    "flash_attention_decode",
    "paged_decode_attention",
    "triton_available",
    "backend_label",
    "compiled_variants",
    "flash_attention_varlen_ref",
    "flash_attention_decode_ref",
    "paged_decode_attention_ref",
]

if importlib.util.find_spec("triton") is not None:
    from .decode_attention import flash_attention_decode
    from .flash_attention import flash_attention_varlen
    from .launch import backend_label, triton_available
    from .paged_attention import paged_decode_attention
    from .variants import compiled_variants
else:  # triton is not installed (e.g. some CPU-only platforms): keep the package importable

    def triton_available(device) -> bool:
        """Triton is not installed, so the kernels cannot run anywhere."""
        return False

    def backend_label(device) -> str:
        """Triton is not installed: nothing runs the kernels."""
        return "unavailable"

    def compiled_variants() -> int:
        """Triton is not installed: nothing is compiled."""
        return 0

    def _missing(name: str):
        def fn(*args, **kwargs):
            raise RuntimeError(f"{name}: triton is not installed, so the Triton kernels cannot run. Use "
                               f"ablate_kernels.reference.{name}_ref or "
                               "torch.nn.functional.scaled_dot_product_attention instead.")
        fn.__name__ = name
        return fn

    flash_attention_varlen = _missing("flash_attention_varlen")
    flash_attention_decode = _missing("flash_attention_decode")
    paged_decode_attention = _missing("paged_decode_attention")
