"""What a step should cost: FLOPs and bytes moved, from the model shape and what the step feeds.

Per step, for sequences b with q_b new queries and c_b keys after the step:
  FLOPs = 2 N_lin T + 4 H d_h sum_l sum_b [f_l(c_b) - f_l(c_b - q_b)] + 2 d V N_logits
  bytes = weight bytes (every projection and the LM head, read once) + KV read + KV written
with T = sum_b q_b, N_lin the projection parameters, f_l(n) = sum_{x=1..n} min(x, W_l) the keys the
queries at positions 0..n-1 of layer l see (W_l its sliding window, infinite for a full layer: then
f(c) - f(c - q) = q (c - q) + q (q + 1) / 2), KV read = sum_l sum_b min(c_b - q_b, W_l - 1) x bytes per
token and layer (the keys before the step that its queries see) for a cache that keeps K/V (none
without one), KV written = T x bytes per token.
A mixture of experts: N_lin counts the k experts each token runs (of E per MoE layer), and a step
reads the experts its tokens reach, at most min(E, k T) per MoE layer (every expert from T >= E / k).
A step takes at least max(FLOPs / peak FLOP/s, bytes / peak bandwidth) (the roofline).
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.model.config import ModelConfig


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float


def keys_seen(n: int, window: int | None) -> int:
    """sum over x = 1..n of min(x, window): the keys the queries at positions 0..n-1 see."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


class CostModel:
    def __init__(self, cfg: ModelConfig, keeps_kv: bool, kv_token_bytes: int | None = None) -> None:
        """kv_token_bytes: what the arm's cache stores per token (KVCache.bytes_per_token); default
        the model's K/V in its dtype."""
        self.cfg = cfg
        self.keeps_kv = keeps_kv
        # what each token multiplies by: of a mixture of experts' routed experts, the k it reaches
        self.linear_params = (cfg.num_params(include_embeddings=False, active=True)
                              - cfg.n_layers * 2 * cfg.d_model - cfg.d_model)
        self.head_params = cfg.vocab_size * cfg.d_model
        self.weight_bytes = (self.linear_params + self.head_params) * cfg.torch_dtype.itemsize   # one token's
        # one routed expert's bytes summed over the MoE layers (0 for a dense model)
        self.expert_bytes = cfg.num_moe_layers * (cfg.moe_params(1) - cfg.moe_params(0)) * cfg.torch_dtype.itemsize
        self.kv_token_bytes = kv_token_bytes if kv_token_bytes is not None else cfg.kv_bytes_per_token()
        # window -> how many layers have it (None: full attention)
        self.windows: dict[int | None, int] = {}
        for layer in range(cfg.n_layers):
            window = cfg.layer_window(layer)
            self.windows[window] = self.windows.get(window, 0) + 1

    def step(self, query_lens: list[int], context_lens: list[int], num_logits: int) -> StepCost:
        cfg = self.cfg
        tokens = sum(query_lens)
        pairs = list(zip(query_lens, context_lens))
        attended = sum(layers * sum(keys_seen(c, w) - keys_seen(c - q, w) for q, c in pairs)
                       for w, layers in self.windows.items())                       # over every layer
        flops = (2 * self.linear_params * tokens
                 + 4 * cfg.n_heads * cfg.head_dim * attended
                 + 2 * self.head_params * num_logits)
        history = sum(layers * sum(c - q if w is None else min(c - q, w - 1) for q, c in pairs)
                      for w, layers in self.windows.items())                        # keys read, every layer
        kv_read = history * self.kv_token_bytes / cfg.n_layers if self.keeps_kv else 0
        kv_written = tokens * self.kv_token_bytes if self.keeps_kv else 0
        k = cfg.n_experts_per_token
        more_experts = min(cfg.n_experts, k * tokens) - k if cfg.n_experts else 0   # reached beyond one token's k
        weights = self.weight_bytes + more_experts * self.expert_bytes
        return StepCost(float(flops), float(weights + kv_read + kv_written))
