"""attention=sdpa: PyTorch's scaled_dot_product_attention, recording the backend it picked.

Causal prefill of sequences with no history uses is_causal (eligible for the fused flash kernels);
anything else (decode, chunks after a prefix, ragged batches) passes the boolean mask. A layer with a
sliding window always passes the mask (with the window); one with soft-capped scores (Gemma 2) runs
an explicit softmax instead (ablate.api.softcapped_attention: SDPA cannot cap the scores).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ablate.api import (Attention, KVView, LayerAttention, PluginConfig, Stat, StepInputs, causal_mask, pad_queries,
                        softcapped_attention, unpad_queries)


@dataclass
class SDPAConfig(PluginConfig):
    name: str = "sdpa"


def sdpa_backend(q, k, v, mask, is_causal: bool) -> str:
    """The backend PyTorch's dispatcher chooses for these inputs (flash, efficient, cudnn, math...)."""
    try:
        from torch.nn.attention import SDPBackend
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, enable_gqa=True)
        return SDPBackend(choice).name.lower()
    except Exception:   # a private API: if it moves, say so rather than guess
        return "unknown"


def plain_causal(step: StepInputs) -> bool:
    """Every sequence is a whole prompt of the same length with no history: is_causal says it all."""
    no_history = all(ql == cl for ql, cl in zip(step.query_lens, step.kv_lens))
    return no_history and len(set(step.query_lens)) == 1


def _unmasked(step: StepInputs) -> bool:
    """One query per sequence and keys of one length: every query sees every key, no mask needed."""
    return all(ql == 1 for ql in step.query_lens) and len(set(step.kv_lens)) == 1


class SDPAAttention(Attention):
    name = "sdpa"
    config_class = SDPAConfig
    graph_safe = True     # a captured decode step reads every row's capacity, masked by kv_lens_t
    features = frozenset({"sliding_window", "softcap"})
    reads_key_rings = True   # causal_mask(..., view.ring)
    reported_stats = (Stat("backends", "the implementation that ran, per kind of step", "text", "first"),)

    def __init__(self, config: SDPAConfig, ctx) -> None:
        super().__init__(config, ctx)
        self.backends: dict[str, str] = {}    # kind of step (decode, causal, masked) -> backend

    @property
    def backend(self) -> str:
        picked = ",".join(f"{kind}={b}" for kind, b in sorted(self.backends.items()))
        return f"sdpa({picked})" if picked else "sdpa"

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs,
                 layer: LayerAttention | None = None) -> torch.Tensor:
        k, v = view.padded(step)                                     # (B, S, H_kv, D)
        qp = pad_queries(q, step).transpose(1, 2)                    # (B, H, Lq, D)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                  # (B, H_kv, S, D)
        if layer is not None:                                        # a window, soft-capped scores: masked
            mask = causal_mask(step, k.shape[2], layer.window, view.ring)[:, None]   # (B, 1, Lq, S)
            if layer.softcap is not None:
                self.backends.setdefault("softcapped", "explicit")
                out = softcapped_attention(qp, k, v, mask, layer.softcap)
            else:
                self.backends.setdefault("windowed", "masked")
                out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)
            return unpad_queries(out.transpose(1, 2), step)          # (T, H, D)
        # a captured step reads every row's capacity (view.padded), masked by its kv_lens_t
        is_causal = not step.graphed and step.memo("sdpa_is_causal", lambda: plain_causal(step))
        unmasked = is_causal or not step.graphed and step.memo("sdpa_unmasked", lambda: _unmasked(step))
        mask = None if unmasked else causal_mask(step, k.shape[2])[:, None]   # (B, 1, Lq, S)
        kind = ("decode-graphed" if step.graphed else "decode" if step.is_decode
                else "causal" if is_causal else "masked")
        if kind not in self.backends:
            self.backends[kind] = sdpa_backend(qp, k, v, mask, is_causal)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        return unpad_queries(out.transpose(1, 2), step)              # (T, H, D)

    def stats(self) -> dict[str, float]:
        return {"backends": self.backend}
