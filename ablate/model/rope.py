"""Rotary position embeddings (RoPE), with Llama 3.1's and YaRN's frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from ablate.model import native
from ablate.model.config import ModelConfig


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's RoPE scaling, as Hugging Face's `_compute_llama3_parameters`: with wavelength
    w = 2 pi / f and L the original context, frequencies with w < L / high_freq_factor are kept,
    those with w > L / low_freq_factor are divided by `factor`, and in between
    f' = (1 - s) f / factor + s f with s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def yarn_inv_freq(dim: int, base: float, scaling: dict[str, float]) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023), as Hugging Face's `_compute_yarn_parameters` (truncated
    correction range): pair i keeps w_i = base^(-2i/D) where it turns more than beta_fast times over
    the original context L, is divided by `factor` where it turns fewer than beta_slow times, and
    blends linearly in between. Pair i turns L w_i / (2 pi) times; the blend's ends are the (floored,
    ceiled) pair indices where that equals beta_fast and beta_slow."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:     # the (fractional) pair index turning `turns` times over L
        return dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(scaling["beta_fast"])), 0)
    high = min(math.ceil(pair_turning(scaling["beta_slow"])), dim - 1)
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)       # ramp 0: as trained; 1: interpolated


class RotaryEmbedding(nn.Module):
    """RoPE, "rotate-half" layout (as Hugging Face's Llama): dims i and i + D/2 rotate together.

    x' = x cos(p w) + rotate_half(x) sin(p w), rotate_half(x1, x2) = (-x2, x1), w_i = base^(-2i/D).
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float,
                 llama3_scaling: dict[str, float] | None = None,
                 explicit_inv_freq: torch.Tensor | None = None,
                 yarn_scaling: dict[str, float] | None = None) -> None:
        super().__init__()
        # tables on the CPU even inside a meta-device construction (moved with the model later)
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
        if llama3_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, llama3_scaling)
        if yarn_scaling:
            inv_freq = yarn_inv_freq(head_dim, base, yarn_scaling)
        if explicit_inv_freq is not None:   # given frequencies (an MLA conversion keeps a subset of a model's)
            inv_freq = explicit_inv_freq.to(torch.float64)
        positions = torch.arange(max_seq_len, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, inv_freq.cpu())                                           # (S, D/2)
        angles = torch.cat((angles, angles), dim=-1)                                               # (S, D)
        # YaRN scales the rotated q and k each by its attention factor (scores on the rotary dims by its square)
        gain = yarn_scaling["attention_factor"] if yarn_scaling else 1.0
        self.register_buffer("cos", (angles.cos() * gain).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * gain).float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D) for this step's positions, computed once and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, H, D); cos, sin (T, 1, D)
    if native.takes(x) and cos.dtype == torch.float32:     # one pass, not six operations
        return native.rope(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    """RoPE over each head's dims (mha), or over the rotary key k_R only (mla: the latent has no position)."""
    dims = cfg.rope_head_dim if cfg.attention_kind == "mla" else cfg.head_dim
    return RotaryEmbedding(dims, cfg.max_seq_len, cfg.rope_base, cfg.rope_llama3_scaling,
                           yarn_scaling=cfg.rope_yarn_scaling)
