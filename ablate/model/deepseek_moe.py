"""DeepSeek-V2/V3's mixture of experts: ablate/model/moe.py's experts with DeepSeek's routing.

For T tokens, E routed experts in G equal groups, k experts a token (as transformers 5 computes it):

    V2  s = softmax(x W_r^T)                                  (T, E), fp32
        groups (group_limited_greedy): a group's score is its best s; the best topk_groups groups
        keep their experts, the others' s are zeroed; w, e = top-k(s)      (greedy: no groups)
    V3  s = sigmoid(x W_r^T);  c = s + b                      b: a learnt per-expert bias (e_score_correction_bias)
        a group's score is the sum of its two best c; the best topk_groups groups keep their
        experts; e = top-k(c) over those, w = s_e (the bias only chooses); w / sum(w) when
        norm_topk_prob
    y_t = routed_scaling x sum_j w_tj SwiGLU_{e_tj}(x_t) + SwiGLU_shared(x_t)

The shared experts are one SwiGLU of n_shared_experts x moe_intermediate_size, ungated. Everything
after routing (sorting the slots by expert, the loop or grouped products) is MixtureOfExperts'.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ablate.model.config import ModelConfig
from ablate.model.moe import MixtureOfExperts


def deepseek_top_k(router_logits: torch.Tensor, k: int, *, sigmoid: bool, score_bias: torch.Tensor | None,
                   groups: int, topk_groups: int, normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k) fp32, expert ids (T, k)), DeepSeek-V2 (softmax scores)
    or V3 (sigmoid scores, the choice made on scores + score_bias), within the best `topk_groups`
    of `groups` groups of experts when groups > 0."""
    logits = router_logits.float()
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)                       # (T, E)
    choice = scores + score_bias.float() if score_bias is not None else scores             # (T, E)
    if groups:
        t, e = choice.shape
        grouped = choice.view(t, groups, e // groups)                                       # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.max(dim=-1).values   # (T, G)
        kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, 1.0)
        kept = kept.bool().unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)      # (T, E)
        # V3 drops the others' choices to -inf; V2 zeroes their scores (all others are > 0)
        choice = choice.masked_fill(~kept, float("-inf") if sigmoid else 0.0)
    ids = choice.topk(k, dim=-1).indices                                                    # (T, k)
    weights = scores.gather(1, ids)                                                         # (T, k): s, not s + b
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class DeepSeekExperts(MixtureOfExperts):
    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__(cfg, shared_expert)
        self.sigmoid = cfg.moe_router == "deepseek_v3"
        self.groups, self.topk_groups, self.scale = cfg.moe_groups, cfg.moe_topk_groups, cfg.routed_scaling
        # V3's e_score_correction_bias: added to the scores for the choice of experts only
        self.score_bias = nn.Parameter(self.router.weight.new_zeros(self.num_experts)) if self.sigmoid else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) in x's dtype, expert ids (T, k))."""
        weights, ids = deepseek_top_k(self.router(x), self.top_k, sigmoid=self.sigmoid, score_bias=self.score_bias,
                                      groups=self.groups, topk_groups=self.topk_groups, normalise=self.normalise,
                                      scale=self.scale)
        return weights.to(x.dtype), ids

    def load_hf(self, read: Callable[[str, tuple[int, ...]], torch.Tensor], has: Callable[[str], bool],
                prefix: str) -> None:
        """DeepSeek's names under `prefix` ("layers.N."): mlp.gate.weight (E, d) and, V3,
        mlp.gate.e_score_correction_bias (E,); mlp.experts.E.{gate,up,down}_proj.weight (or
        transformers' fused mlp.experts.gate_up_proj / down_proj); mlp.shared_experts.{gate,up,down}_proj."""
        num, f, d = self.num_experts, self.d_ff, self.w_down.shape[1]
        mlp = prefix + "mlp."
        self.router.weight.copy_(read(mlp + "gate.weight", (num, d)))
        if self.score_bias is not None:
            self.score_bias.copy_(read(mlp + "gate.e_score_correction_bias", (num,)))
        if has(mlp + "experts.gate_up_proj"):
            self.w_gate_up.copy_(read(mlp + "experts.gate_up_proj", (num, 2 * f, d)))
            self.w_down.copy_(read(mlp + "experts.down_proj", (num, d, f)))
        else:
            for e in range(num):
                expert = f"{mlp}experts.{e}."
                self.w_gate_up[e, :f].copy_(read(expert + "gate_proj.weight", (f, d)))
                self.w_gate_up[e, f:].copy_(read(expert + "up_proj.weight", (f, d)))
                self.w_down[e].copy_(read(expert + "down_proj.weight", (d, f)))
        if self.shared_expert is not None:
            shared, width = mlp + "shared_experts.", self.shared_expert.d_ff
            self.shared_expert.w_gate_up.weight[:width].copy_(read(shared + "gate_proj.weight", (width, d)))
            self.shared_expert.w_gate_up.weight[width:].copy_(read(shared + "up_proj.weight", (width, d)))
            self.shared_expert.w_down.weight.copy_(read(shared + "down_proj.weight", (d, width)))
