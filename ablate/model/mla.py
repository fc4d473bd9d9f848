"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1): K and V from one cached latent.

Per token x (d_model) and query head h, with d_h the head width, d_c the latent width and d_R the
rotary key width:

    [q_h^C, q_h^R] = W_Q x                 (d_h + d_R,) per head: content and rotary query
    c     = W_DKV x                         (d_c,)  the KV latent              } all a token caches:
    k^R   = RoPE(W_KR x)                    (d_R,)  one rotary key for all heads } d_c + d_R numbers
    k_h^C = W_UK,h c,   v_h = W_UV,h c      (d_h,)  up-projected per head
    score_h(s, t) = (q_h^C(s) . k_h^C(t) + RoPE(q_h^R(s)) . k^R(t)) / sqrt(d_h + d_R)
    o_h(s) = sum_t softmax_t(score_h(s, .)) v_h(t);    out = W_O [o_1 ... o_H]

RoPE depends on the key's position, so it cannot act on k^C: W_UK could then not be moved past it
(below). The decoupled k^R carries the position instead, shared by every head.

Two ways to compute the same thing:
- explicit (prefill, and the readable reference): up-project every cached c into k_h^C and v_h and
  run ordinary attention over K = [k^C, k^R] and V, per head.
- absorbed (decode): q_h^C . W_UK,h c = (W_UK,h^T q_h^C) . c, so the query moves into latent space
  (d_c,) and attends over the cached rows [c, k^R] as they are: one "KV head" shared by every query
  head (MQA over latents). And sum_t p_t W_UV,h c_t = W_UV,h (sum_t p_t c_t): attention returns a
  latent per head and W_UV,h is applied once after it, on the way into W_O. A decode step reads
  d_c + d_R numbers per cached token instead of 2 H d_h, and materialises nothing per head per token.

Both go through the attention slot, which computes softmax(q k^T / sqrt(D)) v with one width D for
q, k and v. The absorbed form hands it K = V = the cached rows (width d_c + d_R, no copy) and keeps
the first d_c columns of the output (the rest is sum_t p_t k^R_t, unused); the explicit form pads v
with zeros from d_h to d_h + d_R and drops those columns. The slot scales scores by 1/sqrt(D), so
the query is multiplied by sqrt(D / (d_h + d_R)) first: MLA's scale is 1/sqrt(d_h + d_R) either way.

The cache stores [c, k^R] as K of one head and nothing as V (KVSpec: 1 head, K width d_c + d_R,
V width 0; ModelConfig.kv_cache_widths).

Simplifications against DeepSeek-V2: no low-rank query compression (W_Q is full, as in
DeepSeek-V2-Lite), no RMSNorm on c (so that a truncated SVD of a checkpoint's K/V projections maps
onto W_DKV and W_UK / W_UV directly: ablate_variants.mla), no YaRN scaling of the rotary key.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ablate.api.kv import KVView, PackedKV, PaddedKV, PagedKV
from ablate.model.config import ModelConfig
from ablate.model.linear import Linear
from ablate.model.rope import apply_rope

if TYPE_CHECKING:
    from ablate.api.step import StepInputs
    from ablate.model.forward import Forward
    from ablate.model.llama import LlamaModel


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.latent_dim, self.rope_dim = cfg.kv_latent_dim, cfg.rope_head_dim
        self.q_size = cfg.n_heads * (cfg.head_dim + cfg.rope_head_dim)
        # W_Q, W_DKV and W_KR fused into one matmul (as wqkv is in SelfAttention)
        self.wq_ckv_kr = Linear(cfg.d_model, self.q_size + self.latent_dim + self.rope_dim, bias=False)
        self.w_uk = Linear(self.latent_dim, cfg.n_heads * cfg.head_dim, bias=False)   # W_UK: c -> k_h^C, all heads
        self.w_uv = Linear(self.latent_dim, cfg.n_heads * cfg.head_dim, bias=False)   # W_UV: c -> v_h, all heads
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.absorb = True      # decode with the up-projections absorbed; False: the explicit path (checks)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fwd: Forward) -> torch.Tensor:
        t = x.shape[0]
        h, dh, dc, dr = self.n_heads, self.head_dim, self.latent_dim, self.rope_dim
        q, c, k_r = self.wq_ckv_kr(x).split((self.q_size, dc, dr), dim=-1)
        q_c, q_r = q.view(t, h, dh + dr).split((dh, dr), dim=-1)           # (T, H, d_h), (T, H, d_R)
        q_r = apply_rope(q_r, *rope)                                         # (T, H, d_R)
        k_r = apply_rope(k_r.view(t, 1, dr), *rope)                          # (T, 1, d_R)
        rows = torch.cat((c.view(t, 1, dc), k_r), dim=-1)                    # (T, 1, d_c + d_R): what a token caches
        view = fwd.store(self.layer, rows, rows[..., :0])                    # nothing in V
        if fwd.step.is_decode and self.absorb:
            out = self.absorbed(q_c, q_r, view, fwd)
        else:
            out = self.explicit(q_c, q_r, view, fwd)
        return self.wo(out.reshape(t, h * dh))                               # (T, d)

    def score_scale_fix(self, slot_width: int) -> float:
        """The slot scales by 1/sqrt(slot_width); MLA's scores are scaled by 1/sqrt(d_h + d_R)."""
        return math.sqrt(slot_width / (self.head_dim + self.rope_dim))

    def absorbed(self, q_c: torch.Tensor, q_r: torch.Tensor, view: KVView, fwd: Forward) -> torch.Tensor:
        """Attention over the cached latents, W_UK absorbed into the query and W_UV applied after."""
        h, dh, dc, dr = self.n_heads, self.head_dim, self.latent_dim, self.rope_dim
        w_uk = self.w_uk.weight.view(h, dh, dc)                               # (H, d_h, d_c)
        w_uv = self.w_uv.weight.view(h, dh, dc)                               # (H, d_h, d_c)
        q_latent = torch.einsum("thd,hdc->thc", q_c, w_uk)                    # (T, H, d_c): W_UK,h^T q_h^C
        q = torch.cat((q_latent, q_r), dim=-1) * self.score_scale_fix(dc + dr)   # (T, H, d_c + d_R)
        out = fwd.attend(self.layer, q, rows_as_keys_and_values(view))       # (T, H, d_c + d_R)
        o_latent = out[..., :dc]                                              # (T, H, d_c): sum_t p_t c_t
        return torch.einsum("thc,hdc->thd", o_latent, w_uv)                   # (T, H, d_h): W_UV,h o_latent

    def explicit(self, q_c: torch.Tensor, q_r: torch.Tensor, view: KVView, fwd: Forward) -> torch.Tensor:
        """The readable form: K and V up-projected for every cached token, then ordinary attention."""
        h, dh, dc, dr = self.n_heads, self.head_dim, self.latent_dim, self.rope_dim
        rows, as_view = cached_rows(view, fwd.step)                           # (..., 1, d_c + d_R)
        c, k_r = rows[..., 0, :dc], rows[..., dc:]                            # (..., d_c), (..., 1, d_R)
        lead = c.shape[:-1]                                                   # (T,) packed or (B, S) padded
        k_c = self.w_uk(c).view(*lead, h, dh)                                 # (..., H, d_h)
        v = self.w_uv(c).view(*lead, h, dh)                                   # (..., H, d_h)
        k = torch.cat((k_c, k_r.expand(*lead, h, dr)), dim=-1)                # (..., H, d_h + d_R)
        v = F.pad(v, (0, dr))                                                 # (..., H, d_h + d_R), zeros past d_h
        q = torch.cat((q_c, q_r), dim=-1) * self.score_scale_fix(dh + dr)     # (T, H, d_h + d_R); the fix is 1
        return fwd.attend(self.layer, q, as_view(k, v))[..., :dh]           # (T, H, d_h)


def rows_as_keys_and_values(view: KVView) -> KVView:
    """The cached rows [c, k^R] as both K and V, without a copy."""
    if isinstance(view, PagedKV):
        return dataclasses.replace(view, v_cache=view.k_cache)
    return dataclasses.replace(view, v=view.k)


def cached_rows(view: KVView, step: StepInputs) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], KVView]]:
    """The cached rows, packed (T, 1, W) for the `none` cache or padded (B, S, 1, W) for the others,
    and how to wrap K and V computed from them into a view of the same layout."""
    if isinstance(view, PackedKV):
        return view.k, PackedKV
    rows, _ = view.padded(step)
    return rows, PaddedKV


def set_absorbed(model: LlamaModel, absorb: bool) -> LlamaModel:
    """Switch every MLA layer's decode between the absorbed (True) and the explicit (False) path."""
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.absorb = absorb
    return model
