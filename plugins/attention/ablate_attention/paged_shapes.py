"""Which of attention=paged's decode kernels can take a model's decode steps, as far as its build context
tells: the Triton kernel's shapes (ablate_attention.flash.unsupported_shape) and the native kernel's
(ablate.api.native.paged_decode_problem), checked on stand-ins of a decode step's tensors.
"""
from __future__ import annotations

import torch

from ablate.api import BuildContext, native
from ablate_attention.flash import unsupported_shape


def decode_widths(ctx: BuildContext) -> tuple[int, int, int]:
    """The widths of a decode step's q, K and V. MHA decodes queries of model.head_dim over the cache's
    K and V widths; MLA's absorbed decode queries the cached rows [c, k^R] themselves, K = V = those
    rows (kv_latent_dim + rope_head_dim)."""
    spec = ctx.kv_spec
    if getattr(ctx.model.config, "attention_kind", "mha") == "mla":
        return spec.k_head_dim, spec.k_head_dim, spec.k_head_dim
    return ctx.model.config.head_dim, spec.k_head_dim, spec.v_head_dim


def decode_shape_problem(ctx: BuildContext) -> str | None:
    """Why the Triton kernel cannot take this model's decode steps, as far as the build context tells, or None."""
    # shape-only stand-ins: the check each decode step runs (flash's unsupported_shape) decides here too
    q, k, v = (torch.empty(0, width, dtype=ctx.kv_spec.dtype, device="meta") for width in decode_widths(ctx))
    return unsupported_shape(q, k, v)


def native_shape_problem(ctx: BuildContext) -> str | None:
    """Why the native kernel cannot take this model's decode steps (one-row stand-ins of its tensors), or None."""
    spec = ctx.kv_spec
    q_width, k_width, v_width = decode_widths(ctx)
    q = torch.empty(1, ctx.model.config.n_heads, q_width, dtype=spec.dtype, device="cpu")
    k, v = (torch.empty(1, 1, spec.n_kv_heads, width, dtype=spec.dtype, device="cpu") for width in (k_width, v_width))
    return native.paged_decode_problem(q, k, v)


def mla_hint(ctx: BuildContext) -> str:
    """For MLA, where the width the kernel sees comes from."""
    cfg = ctx.model.config
    if getattr(cfg, "attention_kind", "mha") != "mla":
        return ""
    return (f" (MLA decodes over the cached rows, model.kv_latent_dim + model.rope_head_dim = "
            f"{cfg.kv_latent_dim} + {cfg.rope_head_dim} wide; with variant=mla those are variant.rank and "
            "2 x variant.rope_frequencies x the source's n_kv_heads)")
