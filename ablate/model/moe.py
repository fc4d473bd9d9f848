"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): each token runs k of E SwiGLU experts.

For T tokens x (T, d), E experts of width F, k experts a token:

    p = softmax(x W_r^T)                      (T, E), in fp32 as transformers does (W_r: the router)
    w, e = top-k(p)                           (T, k): weights and expert ids; w / sum(w) when
                                              model.norm_topk_prob (Mixtral; Qwen's norm_topk_prob)
    y_t = sum_j w_tj SwiGLU_{e_tj}(x_t)       (+ sigmoid(x_t . w_g) SwiGLU_shared(x_t) for Qwen2-MoE)

Routing is one method (`MixtureOfExperts.route`, over the free function `softmax_top_k`), so a
family that scores experts otherwise (sigmoid scores, group-limited top-k, a scaling factor)
replaces that function and keeps the rest.

Every expert's weights sit in two tensors, read by both ways of computing the experts:
w_gate_up (E, 2F, d), rows gate then up as in SwiGLU's fused w_gate_up, and w_down (E, d, F). The
T k (token, expert) slots are sorted by expert; then, by `engine.moe_experts`:

  loop      one pair of products per expert that any token reached, over its rows of the sorted
            slots (the counts read on the host: one sync per layer). The plain form: what
            transformers' eager experts do.
  grouped   one grouped product per projection over all sorted rows (torch's grouped_mm, the
            groups cut by per-expert offsets that stay on the device: no host sync, capturable
            in a CUDA graph). torch runs it on the CPU in every dtype, on CUDA in bf16 on SM80+.

Both compute each slot's output on its own, then sum a token's k slots in rank order, so the two
differ only in how each product is blocked: logits agree to rounding and greedy text is the same.
The expert products go to torch (F.linear, grouped_mm), not to ablate.model.linear's timed CPU
paths, whose layouts are chosen per 2-D weight; the router and the shared expert are Linear.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ablate.api.context import MOE_EXPERTS
from ablate.model.config import ModelConfig
from ablate.model.linear import Linear


def softmax_top_k(router_logits: torch.Tensor, k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k) fp32, expert ids (T, k)): the k largest of softmax(logits)
    in fp32, rescaled to sum to 1 when `normalise`. Ties go to the lower expert id, as torch.topk's do."""
    probs = torch.softmax(router_logits.float(), dim=-1)                   # (T, E)
    weights, ids = torch.topk(probs, k, dim=-1)                            # (T, k), largest first
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(R, 2F) rows [gate, up] -> (R, F): silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MixtureOfExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        """`shared_expert`: the SwiGLU every token also runs (built by the caller), or None."""
        super().__init__()
        self.num_experts, self.top_k, self.normalise = cfg.n_experts, cfg.n_experts_per_token, cfg.norm_topk_prob
        self.d_ff = cfg.expert_d_ff or cfg.d_ff
        d = cfg.d_model
        self.router = Linear(d, self.num_experts, bias=False)                                   # W_r (E, d)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_experts, 2 * self.d_ff, d))          # (E, 2F, d)
        self.w_down = nn.Parameter(torch.empty(self.num_experts, d, self.d_ff))                 # (E, d, F)
        self.shared_expert = shared_expert
        self.shared_gate = Linear(d, 1, bias=False) if cfg.shared_expert_gate else None         # w_g (1, d)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) in x's dtype, expert ids (T, k))."""
        weights, ids = softmax_top_k(self.router(x), self.top_k, self.normalise)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, strategy: str = "loop") -> torch.Tensor:
        """x (T, d) -> (T, d), the routed experts computed by `strategy` (engine.moe_experts: MOE_EXPERTS)."""
        t, d = x.shape
        weights, ids = self.route(x)                                           # (T, k), (T, k)
        flat = ids.flatten()                                                   # (S,): slot s is token s // k
        order = flat.argsort(stable=True)                                      # (S,) slots sorted by expert
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))                                    # (E,) slots per expert
        rows = x.index_select(0, order // self.top_k)                          # (S, d) sorted by expert
        if strategy == "grouped":
            out_sorted = self._grouped(rows, counts)
        elif strategy == "loop":
            out_sorted = self._loop(rows, counts)
        else:
            raise ValueError(f"engine.moe_experts must be one of {', '.join(MOE_EXPERTS)}, got {strategy!r}")
        out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # (S, d) back in slot order
        y = (out.view(t, self.top_k, d) * weights.unsqueeze(-1)).sum(dim=1)   # (T, d): k slots in rank order
        if self.shared_expert is not None:
            shared = self.shared_expert(x)                                     # (T, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared           # (T, 1) x (T, d)
            y = y + shared
        return y

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted rows (S, d) -> (S, d): per expert reached, F.linear over its consecutive rows."""
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):                               # one host sync
            if n:
                h = _silu_mul(F.linear(rows[start:start + n], self.w_gate_up[e]))   # (n, F)
                out[start:start + n] = F.linear(h, self.w_down[e])                  # (n, d)
            start += n
        return out

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted rows (S, d) -> (S, d): one grouped product per projection, groups ending at `offsets`."""
        offsets = counts.cumsum(0).to(torch.int32)                            # (E,) end of each expert's rows
        if _eager_grouped is not None and torch.compiler.is_compiling():
            return _eager_grouped(rows, self.w_gate_up, self.w_down, offsets)
        return _grouped_products(rows, self.w_gate_up, self.w_down, offsets)

    def load_hf(self, read: Callable[[str, tuple[int, ...]], torch.Tensor], has: Callable[[str], bool],
                prefix: str) -> None:
        """Copy a checkpoint's MoE tensors of one layer (`prefix`: "layers.N.") in, one tensor at a time.

        Three namings: Qwen2-/Qwen3-MoE's hub files `mlp.gate.weight` and `mlp.experts.E.{gate,up,
        down}_proj.weight`; Mixtral's `block_sparse_moe.gate.weight` and `...experts.E.w1/w3/w2.weight`
        (w1 gate, w3 up, w2 down); and transformers' own fused 3-D tensors `mlp.experts.gate_up_proj`
        (E, 2F, d) and `mlp.experts.down_proj` (E, d, F), our layout. Qwen2-MoE adds
        `mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight`."""
        num, f, d = self.num_experts, self.d_ff, self.w_down.shape[1]
        mixtral = has(prefix + "block_sparse_moe.gate.weight")
        mlp = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        self.router.weight.copy_(read(mlp + "gate.weight", (num, d)))
        if has(mlp + "experts.gate_up_proj"):
            self.w_gate_up.copy_(read(mlp + "experts.gate_up_proj", (num, 2 * f, d)))
            self.w_down.copy_(read(mlp + "experts.down_proj", (num, d, f)))
        else:
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for e in range(num):
                expert = f"{mlp}experts.{e}."
                self.w_gate_up[e, :f].copy_(read(f"{expert}{gate}.weight", (f, d)))
                self.w_gate_up[e, f:].copy_(read(f"{expert}{up}.weight", (f, d)))
                self.w_down[e].copy_(read(f"{expert}{down}.weight", (d, f)))
        if self.shared_expert is not None:
            shared, width = mlp + "shared_expert.", self.shared_expert.d_ff
            self.shared_expert.w_gate_up.weight[:width].copy_(read(shared + "gate_proj.weight", (width, d)))
            self.shared_expert.w_gate_up.weight[width:].copy_(read(shared + "up_proj.weight", (width, d)))
            self.shared_expert.w_down.weight.copy_(read(shared + "down_proj.weight", (d, width)))
        if self.shared_gate is not None:
            self.shared_gate.weight.copy_(read(mlp + "shared_expert_gate.weight", (1, d)))


def _grouped_products(rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      offsets: torch.Tensor) -> torch.Tensor:
    """(S, d) rows sorted by expert, expert e's rows ending at offsets[e] -> (S, d) of their experts."""
    h = _silu_mul(F.grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets))    # (S, F)
    return F.grouped_mm(h, w_down.transpose(1, 2), offs=offsets)                   # (S, d)


# _grouped_products kept out of torch.compile (engine.graphs on a CPU compiles the layers' arithmetic):
# torch's compiler takes grouped_mm in bf16 only. Made on first use (experts_stay_eager), as
# ablate.model.linear's eager products are: importing torch._dynamo costs seconds.
_eager_grouped = None


def experts_stay_eager() -> None:
    """Before torch.compile traces a model: its grouped expert products run eagerly."""
    global _eager_grouped
    if _eager_grouped is None:
        _eager_grouped = torch.compiler.disable(_grouped_products)
