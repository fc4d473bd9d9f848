"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1): K and V from one cached latent.

Per token x (d_model) and query head h, with d_h the content q/k width, d_v the value width, d_c the
latent width and d_R the rotary key width:

    [q_h^C, q_h^R] = W_Q x                 (d_h + d_R,) per head: content and rotary query
                     (or W_UQ norm(W_DQ x): a compressed query c_Q of width d_c', q_lora_rank)
    c     = norm(W_DKV x)                   (d_c,)  the KV latent              } all a token caches:
    k^R   = RoPE(W_KR x)                    (d_R,)  one rotary key for all heads } d_c + d_R numbers
    k_h^C = W_UK,h c  (d_h,),   v_h = W_UV,h c  (d_v,)    up-projected per head
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
  d_c + d_R numbers per cached token instead of H (d_h + d_R + d_v), and materialises nothing per
  head per token.

Both go through the attention slot, which computes softmax(q k^T / sqrt(D)) v with one width D for
q, k and v. The absorbed form hands it K = V = the cached rows (width d_c + d_R, no copy) and keeps
the first d_c columns of the output (the rest is sum_t p_t k^R_t, unused); the explicit form pads
q, k and v with zeros to D = max(d_h + d_R, d_v) and drops v's padding columns. The slot scales
scores by 1/sqrt(D), so the query is multiplied by sqrt(D) x MLA's own scale first.

The cache stores [c, k^R] as K of one head and nothing as V (KVSpec: 1 head, K width d_c + d_R,
V width 0; ModelConfig.kv_cache_widths).

Two forms share this module (ModelConfig's MLA fields):
- DeepSeek-V2/V3 as published (ablate.checkpoints.deepseek reads them; load_hf): a compressed query
  with its RMSNorm (q_lora_rank > 0; V2-Lite has a full W_Q), an RMSNorm on c (latent_norms), d_v
  of its own (v_head_dim), and with YaRN RoPE the score scale times mscale^2 (softmax_mscale).
- what variant=mla converts a Llama-family checkpoint into (ablate_variants.mla): a full W_Q, no
  norm on c (so that a truncated SVD of the K/V projections maps onto W_DKV and W_UK / W_UV
  directly), d_v = d_h.
RoPE is the rotate-half layout in both: DeepSeek's interleaved rotary rows are permuted at load.
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


# DeepSeek's q_a_layernorm and kv_a_layernorm keep their class's default epsilon, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        from ablate.model.llama import RMSNorm    # here: llama.py imports this module at its top

        super().__init__()
        self.layer = layer
        self.n_heads, self.head_dim, self.v_dim = cfg.n_heads, cfg.head_dim, cfg.value_head_dim
        self.latent_dim, self.rope_dim, self.q_rank = cfg.kv_latent_dim, cfg.rope_head_dim, cfg.q_lora_rank
        self.q_size = cfg.n_heads * (cfg.head_dim + cfg.rope_head_dim)
        self.q_in = self.q_rank or self.q_size          # rows of the first block: c_Q, or q itself
        # W_Q (or W_DQ), W_DKV and W_KR fused into one matmul (as wqkv is in SelfAttention)
        self.wq_ckv_kr = Linear(cfg.d_model, self.q_in + self.latent_dim + self.rope_dim, bias=False)
        # DeepSeek-V2/V3: c_Q = W_DQ x, RMS-normalised, then q = W_UQ c_Q; the KV latent normalised too
        self.q_norm = RMSNorm(self.q_rank, LATENT_NORM_EPS) if self.q_rank and cfg.latent_norms else None
        self.w_uq = Linear(self.q_rank, self.q_size, bias=False) if self.q_rank else None
        self.kv_norm = RMSNorm(self.latent_dim, LATENT_NORM_EPS) if cfg.latent_norms else None
        self.w_uk = Linear(self.latent_dim, cfg.n_heads * cfg.head_dim, bias=False)   # W_UK: c -> k_h^C, all heads
        self.w_uv = Linear(self.latent_dim, cfg.n_heads * self.v_dim, bias=False)     # W_UV: c -> v_h, all heads
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=False)
        # MLA's score scale: 1/sqrt(d_h + d_R), times DeepSeek's YaRN mscale^2 when RoPE is YaRN-scaled
        yarn = cfg.rope_yarn_scaling or {}
        self.softmax_scale = yarn.get("softmax_mscale", 1.0) / math.sqrt(cfg.head_dim + cfg.rope_head_dim)
        self.absorb = True      # decode with the up-projections absorbed; False: the explicit path (checks)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fwd: Forward) -> torch.Tensor:
        t = x.shape[0]
        h, dh, dc, dr = self.n_heads, self.head_dim, self.latent_dim, self.rope_dim
        q, c, k_r = self.wq_ckv_kr(x).split((self.q_in, dc, dr), dim=-1)
        if self.w_uq is not None:                                            # q from its own latent c_Q
            q = self.w_uq(q if self.q_norm is None else self.q_norm(q))      # (T, H (d_h + d_R))
        if self.kv_norm is not None:
            c = self.kv_norm(c)                                              # (T, d_c): normalised before caching
        q_c, q_r = q.reshape(t, h, dh + dr).split((dh, dr), dim=-1)        # (T, H, d_h), (T, H, d_R)
        q_r = apply_rope(q_r, *rope)                                         # (T, H, d_R)
        k_r = apply_rope(k_r.reshape(t, 1, dr), *rope)                       # (T, 1, d_R)
        rows = torch.cat((c.reshape(t, 1, dc), k_r), dim=-1)                 # (T, 1, d_c + d_R): what a token caches
        view = fwd.store(self.layer, rows, rows[..., :0])                    # nothing in V
        if fwd.step.is_decode and self.absorb:
            out = self.absorbed(q_c, q_r, view, fwd)
        else:
            out = self.explicit(q_c, q_r, view, fwd)
        return self.wo(out.reshape(t, h * self.v_dim))                       # (T, d)

    def score_scale_fix(self, slot_width: int) -> float:
        """The slot scales by 1/sqrt(slot_width); MLA's scores are scaled by softmax_scale."""
        return math.sqrt(slot_width) * self.softmax_scale

    def absorbed(self, q_c: torch.Tensor, q_r: torch.Tensor, view: KVView, fwd: Forward) -> torch.Tensor:
        """Attention over the cached latents, W_UK absorbed into the query and W_UV applied after."""
        h, dh, dv, dc, dr = self.n_heads, self.head_dim, self.v_dim, self.latent_dim, self.rope_dim
        w_uk = self.w_uk.weight.view(h, dh, dc)                               # (H, d_h, d_c)
        w_uv = self.w_uv.weight.view(h, dv, dc)                               # (H, d_v, d_c)
        q_latent = torch.einsum("thd,hdc->thc", q_c, w_uk)                    # (T, H, d_c): W_UK,h^T q_h^C
        q = torch.cat((q_latent, q_r), dim=-1) * self.score_scale_fix(dc + dr)   # (T, H, d_c + d_R)
        out = fwd.attend(self.layer, q, rows_as_keys_and_values(view))       # (T, H, d_c + d_R)
        o_latent = out[..., :dc]                                              # (T, H, d_c): sum_t p_t c_t
        return torch.einsum("thc,hvc->thv", o_latent, w_uv)                   # (T, H, d_v): W_UV,h o_latent

    def explicit(self, q_c: torch.Tensor, q_r: torch.Tensor, view: KVView, fwd: Forward) -> torch.Tensor:
        """The readable form: K and V up-projected for every cached token, then ordinary attention.
        The slot takes one width D for q, k and v: D = max(d_h + d_R, d_v), the shorter ones padded
        with zeros (zeros add nothing to q . k; a value's padding columns are dropped)."""
        h, dh, dv, dc, dr = self.n_heads, self.head_dim, self.v_dim, self.latent_dim, self.rope_dim
        width = max(dh + dr, dv)
        rows, as_view = cached_rows(view, fwd.step)                           # (..., 1, d_c + d_R)
        c, k_r = rows[..., 0, :dc], rows[..., dc:]                            # (..., d_c), (..., 1, d_R)
        lead = c.shape[:-1]                                                   # (T,) packed or (B, S) padded
        k_c = self.w_uk(c).view(*lead, h, dh)                                 # (..., H, d_h)
        v = self.w_uv(c).view(*lead, h, dv)                                   # (..., H, d_v)
        k = F.pad(torch.cat((k_c, k_r.expand(*lead, h, dr)), dim=-1), (0, width - dh - dr))   # (..., H, D)
        v = F.pad(v, (0, width - dv))                                         # (..., H, D), zeros past d_v
        q = F.pad(torch.cat((q_c, q_r), dim=-1), (0, width - dh - dr)) * self.score_scale_fix(width)   # (T, H, D)
        return fwd.attend(self.layer, q, as_view(k, v))[..., :dv]           # (T, H, d_v)

    def load_hf(self, read: Callable[[str, tuple[int, ...]], torch.Tensor], prefix: str) -> None:
        """Copy DeepSeek-V2/V3's attention tensors under `prefix` (`layers.0.self_attn.`) into place;
        read(name, shape) returns the named tensor, checked to have that shape. The rotary rows must
        already be in the rotate-half layout (ablate.checkpoints.deepseek turns DeepSeek's interleaved
        pairs into it as the tensors are read).

            q_proj (H (d_h + d_R), d), or q_a_proj (d_c', d), q_a_layernorm, q_b_proj (H (d_h + d_R), d_c')
            kv_a_proj_with_mqa (d_c + d_R, d): c and k_R;  kv_a_layernorm (d_c)
            kv_b_proj (H (d_h + d_v), d_c): per head, W_UK's d_h rows then W_UV's d_v rows
            o_proj (d, H d_v)"""
        h, dh, dv, dc, dr = self.n_heads, self.head_dim, self.v_dim, self.latent_dim, self.rope_dim
        d = self.wq_ckv_kr.weight.shape[1]
        fused = self.wq_ckv_kr.weight
        if self.w_uq is None:
            fused[:self.q_size].copy_(read(prefix + "q_proj.weight", (self.q_size, d)))
        else:
            fused[:self.q_rank].copy_(read(prefix + "q_a_proj.weight", (self.q_rank, d)))
            self.w_uq.weight.copy_(read(prefix + "q_b_proj.weight", (self.q_size, self.q_rank)))
            if self.q_norm is not None:
                self.q_norm.weight.copy_(read(prefix + "q_a_layernorm.weight", (self.q_rank,)))
        fused[self.q_in:].copy_(read(prefix + "kv_a_proj_with_mqa.weight", (dc + dr, d)))
        if self.kv_norm is not None:
            self.kv_norm.weight.copy_(read(prefix + "kv_a_layernorm.weight", (dc,)))
        kv_b = read(prefix + "kv_b_proj.weight", (h * (dh + dv), dc)).view(h, dh + dv, dc)
        self.w_uk.weight.copy_(kv_b[:, :dh].reshape(h * dh, dc))
        self.w_uv.weight.copy_(kv_b[:, dh:].reshape(h * dv, dc))
        self.wo.weight.copy_(read(prefix + "o_proj.weight", (d, h * dv)))


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
