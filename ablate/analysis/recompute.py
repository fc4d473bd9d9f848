"""What decoding without a KV cache recomputes: token positions and FLOPs, with a cache and without.

A reply of n tokens after a prompt of p >= 1 tokens takes n forward passes. Pass k (k = 1..n) ends
at sequence length S_k = p + k - 1 and emits token k; the last length fed is m = p + n - 1.

Token positions fed through the model:
    without a cache   every pass feeds the whole sequence:
                      P_none  = sum_{s=p}^{m} s = n p + n (n - 1) / 2
    with a cache      the prompt once, then one new position a pass:
                      P_cache = p + n - 1
    recomputed        P_none - P_cache = (n - 1)(p - 1) + n (n - 1) / 2; with p = 1 this is
                      1 + 2 + ... + (n - 1): 499,500 for n = 1000
    growth            with p = 1, P_none = n (n + 1) / 2: doubling n multiplies it by
                      2 (2n + 1) / (n + 1) = 4 - 2 / (n + 1) -> 4; 4096 against 1000 tokens:
                      4096 x 4097 / (1000 x 1001) = 16.8

FLOPs, for N_lin projection parameters (every matrix of the layers: no norms, no embeddings), L
layers, H query heads of width d_h, d_model d and vocabulary V (ablate.analysis.analytic counts a
step the same way):
    projections       2 N_lin per position fed + 2 d V per pass (the logits of its last position)
                      without a cache: 2 N_lin P_none + 2 d V n    -- quadratic in n
                      with a cache:    2 N_lin P_cache + 2 d V n   -- linear in n
    attention scores  4 L H d_h per query-key pair (Q K^T and P V); causal, the query at position
                      i sees i keys, so a pass feeding s positions does s (s + 1) / 2 pairs:
                      without a cache: A_none  = sum_{s=p}^{m} s (s + 1) / 2 = T(m) - T(p - 1),
                                       T(x) = x (x + 1)(x + 2) / 6            -- cubic in n
                      with a cache:    A_cache = p (p + 1) / 2 + sum_{s=p+1}^{m} s
                                               = m (m + 1) / 2                 -- quadratic in n
    (a materialised attention computes all s^2 scores and masks half: twice these pairs)
Without a cache (p = 1) the projections cost ~N_lin n^2 and attention ~(2/3) L H d_h n^3; attention
overtakes the projections beyond n* = 3 N_lin / (2 L H d_h) tokens (attention_crossover_len).
The quadratic growth usually quoted is the projections'; the cubic attention term dominates only
past n*, e.g. ~74,000 tokens for Llama-2-7B.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.model.config import ModelConfig


def _check(reply_len: int, prompt_len: int) -> None:
    for name, value, low in (("reply_len", reply_len, 1), ("prompt_len", prompt_len, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def positions_without_cache(reply_len: int, prompt_len: int = 1) -> int:
    """P_none = n p + n (n - 1) / 2: every pass feeds the whole sequence so far."""
    _check(reply_len, prompt_len)
    return reply_len * prompt_len + reply_len * (reply_len - 1) // 2


def positions_with_cache(reply_len: int, prompt_len: int = 1) -> int:
    """P_cache = p + n - 1: the prompt once, then the one new token of each later pass."""
    _check(reply_len, prompt_len)
    return prompt_len + reply_len - 1


def recomputed_positions(reply_len: int, prompt_len: int = 1) -> int:
    """P_none - P_cache: positions whose K and V were computed at an earlier pass (p = 1: 1 + ... + (n - 1))."""
    return positions_without_cache(reply_len, prompt_len) - positions_with_cache(reply_len, prompt_len)


def length_ratio(long_len: int, short_len: int, prompt_len: int = 1) -> float:
    """P_none(long) / P_none(short): 4096 against 1000 tokens (p = 1) is 16.8."""
    return positions_without_cache(long_len, prompt_len) / positions_without_cache(short_len, prompt_len)


def doubling_ratio(reply_len: int, prompt_len: int = 1) -> float:
    """P_none(2n) / P_none(n): 4 - 2 / (n + 1) with p = 1, tending to 4."""
    return length_ratio(2 * reply_len, reply_len, prompt_len)


def attention_pairs_without_cache(reply_len: int, prompt_len: int = 1) -> int:
    """T(m) - T(p - 1), T(x) = x (x + 1)(x + 2) / 6: causal pairs summed over every pass."""
    _check(reply_len, prompt_len)
    m = prompt_len + reply_len - 1
    return (m * (m + 1) * (m + 2) - (prompt_len - 1) * prompt_len * (prompt_len + 1)) // 6


def attention_pairs_with_cache(reply_len: int, prompt_len: int = 1) -> int:
    """m (m + 1) / 2: each query-key pair of the final sequence once."""
    _check(reply_len, prompt_len)
    m = prompt_len + reply_len - 1
    return m * (m + 1) // 2


def projection_params(cfg: ModelConfig) -> int:
    """N_lin: the layers' matrices (every parameter but the embeddings and the norms' weights)."""
    return cfg.num_params(include_embeddings=False) - 2 * cfg.n_layers * cfg.d_model - cfg.d_model


def flops_per_pair(cfg: ModelConfig) -> int:
    return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim


@dataclass(frozen=True)
class RecomputeFlops:
    projection: float           # 2 N_lin per position fed + the logits' 2 d V per pass
    attention: float            # 4 L H d_h per causal query-key pair

    @property
    def total(self) -> float:
        return self.projection + self.attention


def _flops(cfg: ModelConfig, positions: int, pairs: int, passes: int) -> RecomputeFlops:
    head = 2 * cfg.d_model * cfg.vocab_size * passes
    return RecomputeFlops(float(2 * projection_params(cfg) * positions + head), float(flops_per_pair(cfg) * pairs))


def flops_without_cache(cfg: ModelConfig, reply_len: int, prompt_len: int = 1) -> RecomputeFlops:
    return _flops(cfg, positions_without_cache(reply_len, prompt_len),
                  attention_pairs_without_cache(reply_len, prompt_len), reply_len)


def flops_with_cache(cfg: ModelConfig, reply_len: int, prompt_len: int = 1) -> RecomputeFlops:
    return _flops(cfg, positions_with_cache(reply_len, prompt_len), attention_pairs_with_cache(reply_len, prompt_len),
                  reply_len)


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> RecomputeFlops:
    """The first pass, the same with a cache and without: what TPOT leaves out."""
    return flops_with_cache(cfg, 1, prompt_len)


def attention_crossover_len(cfg: ModelConfig) -> float:
    """n* = 3 N_lin / (2 L H d_h): past it (p = 1, no cache) attention costs more than the projections."""
    return 3 * projection_params(cfg) / (2 * cfg.n_layers * cfg.n_heads * cfg.head_dim)
