"""attention=sdpa: PyTorch's scaled_dot_product_attention, recording the backend it picked.

Causal prefill of sequences with no history uses is_causal (eligible for the fused flash kernels);
anything else (decode, chunks after a prefix, ragged batches) passes the boolean mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ablate.api import (Attention, KVView, PaddedKV, PagedKV, PluginConfig, Stat, StepInputs, causal_mask, pad_queries,
                        unpad_queries)


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


def _plain_causal(step: StepInputs) -> bool:
    """Every sequence is a whole prompt of the same length with no history: is_causal says it all."""
    no_history = all(ql == cl for ql, cl in zip(step.query_lens, step.kv_lens))
    return no_history and len(set(step.query_lens)) == 1


def _unmasked(step: StepInputs) -> bool:
    """One query per sequence and keys of one length: every query sees every key, no mask needed."""
    return all(ql == 1 for ql in step.query_lens) and len(set(step.kv_lens)) == 1


class SDPAAttention(Attention):
    name = "sdpa"
    config_class = SDPAConfig
    graph_safe = True     # a captured decode step reads every row's full capacity, masked by kv_lens_t
    reported_stats = (Stat("backends", "the implementation that ran, per kind of step", "text", "first"),)

    def __init__(self, config: SDPAConfig, ctx) -> None:
        super().__init__(config, ctx)
        self.backends: dict[str, str] = {}    # kind of step (decode, causal, masked) -> backend

    @property
    def backend(self) -> str:
        picked = ",".join(f"{kind}={b}" for kind, b in sorted(self.backends.items()))
        return f"sdpa({picked})" if picked else "sdpa"

    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        if step.graphed and step.is_decode and isinstance(view, (PaddedKV, PagedKV)):
            return self._graphed_decode(q, view, step)
        k, v = view.padded(step)                                     # (B, S, H_kv, D)
        qp = pad_queries(q, step).transpose(1, 2)                    # (B, H, Lq, D)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                  # (B, H_kv, S, D)
        is_causal = step.memo("sdpa_is_causal", lambda: _plain_causal(step))
        unmasked = is_causal or step.memo("sdpa_unmasked", lambda: _unmasked(step))
        mask = None if unmasked else causal_mask(step)[:, None]      # (B, 1, Lq, S)
        kind = "decode" if step.is_decode else "causal" if is_causal else "masked"
        if kind not in self.backends:
            self.backends[kind] = sdpa_backend(qp, k, v, mask, is_causal)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        return unpad_queries(out.transpose(1, 2), step)              # (T, H, D)

    def _graphed_decode(self, q: torch.Tensor, view: PaddedKV | PagedKV, step: StepInputs) -> torch.Tensor:
        """A decode step captured for replay at other lengths: every row's full capacity (every block
        of the table), the keys past each sequence's length masked through kv_lens_t (the step's
        lists hold the capture's values)."""
        if isinstance(view, PagedKV):
            table = view.block_tables.long()                                       # (B, nb)
            k, v = view.k_cache[table].flatten(1, 2), view.v_cache[table].flatten(1, 2)   # (B, nb * bs, H_kv, D)
        else:
            k, v = view.k, view.v                                                  # (B, S, H_kv, D)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                 # (B, H_kv, S, D)
        keys = torch.arange(k.shape[2], device=q.device)            # (S,)
        mask = (keys[None, :] < step.kv_lens_t[:, None])[:, None, None]   # (B, 1, 1, S)
        qp = q[:, None].transpose(1, 2)                             # (B, H, 1, D)
        self.backends.setdefault("decode-graphed", sdpa_backend(qp, k, v, mask, False))
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)   # (T = B, H, D)

    def stats(self) -> dict[str, float]:
        return {"backends": self.backend}
