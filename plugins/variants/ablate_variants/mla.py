"""variant=mla: convert a checkpoint's K/V projections to multi-head latent attention by truncated SVD.

The MLA layer is ablate.model.mla (its docstring has the maths). Per layer of the source model
(H query heads, G K/V heads of width d_h, half = d_h / 2; RoPE pairs dim i with dim half + i at
frequency w_i, "rotate half"):

RoPE. A rotary key cannot come out of a latent that is cached before its position is applied and
absorbed into the query after (RoPE sits between them). So each source key is split:
- rotary part: the f fastest-turning frequency pairs of every K/V head (dims i and half + i, i < f)
  stay rotary, unchanged: they become the decoupled rotary key k^R, of width d_R = 2 f G (per K/V
  head a block; rotate-half layout over d_R; the rotary table repeats w_0..w_{f-1} per block, so
  these dims turn exactly as before). A query head's rotary query is zero outside its group's block,
  so q_h^R . k^R = the source's q_h . k_g over the kept dims, exactly.
- the other dims (i >= f) lose their rotation: that is the approximation. A pair i contributes
  q_i . R((s - t) w_i) k_i to a score; treating it as position-free is off by the angle (s - t) w_i,
  small for the slow frequencies (w_i = base^(-2i/d_h)): with SmolLM2's base 1e5 and d_h = 64,
  w_16 (s - t) = 1.6 rad at 512 tokens apart, w_24 (s - t) = 0.09 rad. Keeping all pairs (f = half)
  keeps RoPE exact; then only V is compressed. This is the partial-RoPE route of MHA2MLA
  (Ji et al. 2025) with their "high-frequency" selection, without their fine-tuning.

Low rank. The position-free key rows and the value rows are stacked and factorised jointly, so
one latent serves K and V as in MLA:

    M = [W_K^NoPE; W_V]   ((G (d_h - 2f) + G d_h) x d_model)
    M ~ U_r S_r V_r^T     (truncated SVD, rank r = the latent width d_c)
    W_DKV = V_r^T         (r x d_model): c = W_DKV x is what is cached
    [W_UK^G; W_UV^G] = U_r S_r   (rows for each K/V head g); query head h uses its group's rows

so W_UK W_DKV x and W_UV W_DKV x are the best rank-r approximations (in Frobenius norm of the
weights, Eckart-Young) of the source's position-free keys and values. That norm weighs every input
direction alike, and a transformer's inputs are far from alike (a few channels carry most of the
norm): measured on SmolLM2, rank 128 of its 192 value rows takes the held-out perplexity from 27
to over 10^4. With `calibration_tokens`, the factorisation is activation-aware instead (SVD-LLM,
Wang et al. 2024): with C = E[x x^T] over calibration text and C = L L^T,

    M L ~ U_r S_r V_r^T,   W_DKV = V_r^T L^-1,   [W_UK^G; W_UV^G] = U_r S_r

which minimises E||(M - W_U W_DKV) x||^2 over those inputs (same rank, same cache; perplexity 35
at that rank). C comes from the corpus's prompt part (ablate_variants.calibration), never from the
held-out text perplexity is measured on.

Scale. MLA divides scores by sqrt(d_h + d_R), the source by sqrt(d_h): W_Q is multiplied by
sqrt((d_h + d_R) / d_h). The content query keeps all d_h dims with the rotary ones zeroed (W_UK
has zero rows there), so the target layer has head_dim d_h for content and values, as the source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ablate.api import BuildContext, ModelVariant, PluginConfig, QualityBound, Stat
from ablate.api.model import (LlamaModel, ModelConfig, MultiHeadLatentAttention, RotaryEmbedding, SelfAttention,
                              llama3_scaled_inv_freq)
from ablate_variants.calibration import attention_input_moments, calibration_token_ids
from ablate_variants.rebuild import with_new_attention


@dataclass
class MLAConfig(PluginConfig):
    name: str = "mla"
    rank: int = 0               # latent width d_c (the SVD's rank); 0: full rank (only RoPE approximated)
    rope_frequencies: int = 0   # frequency pairs per K/V head kept rotary, fastest first; 0: all (RoPE exact)
    calibration_tokens: int = 0  # > 0: activation-aware SVD over this many corpus tokens; 0: plain SVD of weights

    def __post_init__(self) -> None:
        if self.calibration_tokens < 0:
            raise ValueError(f"variant.calibration_tokens must be >= 0, got {self.calibration_tokens}")
        if self.rank < 0:
            raise ValueError(f"variant.rank must be >= 0, got {self.rank}")
        if self.rope_frequencies < 0:
            raise ValueError(f"variant.rope_frequencies must be >= 0, got {self.rope_frequencies}")


@dataclass(frozen=True)
class MLAShape:
    """The converted layer's widths, checked against the source model."""

    kept_pairs: int      # f: rotary frequency pairs kept per source K/V head
    rank: int            # d_c
    rope_dim: int        # d_R = 2 f G

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, rope_frequencies: int) -> MLAShape:
        half = cfg.head_dim // 2
        f = rope_frequencies or half
        if f > half:
            raise ValueError(f"variant.rope_frequencies={f} exceeds the {half} frequency pairs of a "
                             f"{cfg.head_dim}-dim head")
        rows = cfg.n_kv_heads * (cfg.head_dim - 2 * f) + cfg.n_kv_heads * cfg.head_dim
        full = min(rows, cfg.d_model)
        if rank > full:
            raise ValueError(f"variant.rank={rank} exceeds the rank of [W_K^NoPE; W_V] ({rows} x {cfg.d_model}), "
                             f"at most {full}")
        return cls(f, rank or full, 2 * f * cfg.n_kv_heads)


def source_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """w_i = base^(-2i/d_h), i < d_h / 2, with Llama 3.1 scaling when the model has it (as RotaryEmbedding)."""
    dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu")   # RotaryEmbedding moves its table
    inv_freq = 1.0 / cfg.rope_base ** (dims / cfg.head_dim)
    return llama3_scaled_inv_freq(inv_freq, cfg.rope_llama3_scaling) if cfg.rope_llama3_scaling else inv_freq


def rotary_and_plain_dims(head_dim: int, kept_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices within a head: the kept rotary dims (i and half + i, i < f) and the rest."""
    half = head_dim // 2
    rotary = torch.arange(kept_pairs, device="cpu")          # indices into convert_layer's CPU weights
    rotary = torch.cat((rotary, half + rotary))
    plain = torch.tensor([i for i in range(head_dim) if i % half >= kept_pairs], dtype=torch.long, device="cpu")
    return rotary, plain


def low_rank(m: torch.Tensor, rank: int, input_moment: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """M (rows, d) ~ up (rows, r) @ down (r, d), float64; and the relative error of the fit.

    Plain: the truncated SVD of M, error ||M - M_r||_F / ||M||_F. Activation-aware (input_moment
    C = sum x x^T given): the truncated SVD of M L with C = L L^T, down = V_r^T L^-1, and the error
    is the relative output error on the calibration inputs, ||(M - M_r) L||_F / ||M L||_F."""
    if input_moment is None:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        down = vh[:rank]
    else:
        # a little damping: C is singular when the calibration inputs do not span every direction
        c = input_moment + 1e-6 * input_moment.diagonal().mean() * torch.eye(m.shape[1], dtype=torch.float64, device=m.device)
        chol = torch.linalg.cholesky(c)                                          # C = L L^T
        u, s, vh = torch.linalg.svd(m @ chol, full_matrices=False)
        down = torch.linalg.solve_triangular(chol, vh[:rank], upper=False, left=False)   # V_r^T L^-1
    error = float(s[rank:].square().sum().sqrt() / s.square().sum().sqrt())
    return u[:, :rank] * s[:rank], down, error


def convert_layer(old: SelfAttention, src: ModelConfig, dst: ModelConfig, shape: MLAShape, layer: int,
                  input_moment: torch.Tensor | None = None) -> tuple[MultiHeadLatentAttention, float]:
    """One SelfAttention -> MultiHeadLatentAttention (fp32, CPU), and the factorisation's relative
    error (see `low_rank`)."""
    h, g, dh, d = src.n_heads, src.n_kv_heads, src.head_dim, src.d_model
    f, r, dr = shape.kept_pairs, shape.rank, shape.rope_dim
    per_group = h // g
    weight = old.wqkv.weight.detach().to("cpu", torch.float64)
    w_q, w_k, w_v = weight.split((old.q_size, old.kv_size, old.kv_size))
    w_q, w_k = w_q.view(h, dh, d), w_k.view(g, dh, d)
    rotary, plain = rotary_and_plain_dims(dh, f)

    # rotary key: block g holds head g's kept pairs; rotate-half over d_R puts the first members of
    # every block's pairs in the first half and the second members in the second half
    w_kr = torch.cat((w_k[:, :f].reshape(g * f, d), w_k[:, dh // 2:dh // 2 + f].reshape(g * f, d)))   # (d_R, d)

    # [W_K^NoPE; W_V] ~ U_r S_r V_r^T
    m = torch.cat((w_k[:, plain].reshape(-1, d), w_v))                           # (G (d_h - 2f) + G d_h, d)
    up, w_dkv, error = low_rank(m, r, input_moment)                             # (rows, r) U_r S_r, (r, d)
    up_k, up_v = up.split((g * len(plain), g * dh))
    up_k, up_v = up_k.view(g, len(plain), r), up_v.view(g, dh, r)

    # per query head: content query = all d_h dims with the rotary ones zeroed, W_UK = its group's
    # rows at the plain dims (zero at the rotary ones); rotary query = its group's block of d_R
    scale = math.sqrt((dh + dr) / dh)
    q_content = w_q.clone()
    q_content[:, rotary] = 0.0                                                   # (H, d_h, d)
    q_rotary = torch.zeros(h, dr, d, dtype=torch.float64, device="cpu")          # (H, d_R, d)
    w_uk = torch.zeros(h, dh, r, dtype=torch.float64, device="cpu")
    w_uv = torch.empty(h, dh, r, dtype=torch.float64, device="cpu")
    for head in range(h):
        group = head // per_group
        q_rotary[head, group * f:(group + 1) * f] = w_q[head, :f]
        q_rotary[head, dr // 2 + group * f:dr // 2 + (group + 1) * f] = w_q[head, dh // 2:dh // 2 + f]
        w_uk[head, plain] = up_k[group]
        w_uv[head] = up_v[group]
    w_q_mla = torch.cat((q_content, q_rotary), dim=1).reshape(h * (dh + dr), d) * scale   # (H (d_h + d_R), d)

    with torch.device("meta"):
        new = MultiHeadLatentAttention(dst, layer)
    new = new.to_empty(device="cpu")
    with torch.no_grad():
        new.wq_ckv_kr.weight.copy_(torch.cat((w_q_mla, w_dkv, w_kr)))
        new.w_uk.weight.copy_(w_uk.reshape(h * dh, r))
        new.w_uv.weight.copy_(w_uv.reshape(h * dh, r))
    new.wo = old.wo                    # the output projection is unchanged: share it
    return new, error


def latent_refusal(src: ModelConfig, rank: int, rope_frequencies: int) -> str | None:
    """Why a model of this shape cannot be converted at this rank and rotary width, or None."""
    if src.attention_kind != "mha" or src.qkv_bias or src.qk_norm:
        right = ("run it with variant=none" if src.attention_kind == "mla"
                 else "use a model without Q/K/V biases or per-head q/k norms")
        return (f"variant=mla converts Llama-family K/V projections without biases or norms (model."
                f"attention_kind=mha, qkv_bias=False, qk_norm=False); model {src.name!r} has attention_kind="
                f"{src.attention_kind}, qkv_bias={src.qkv_bias}, qk_norm={src.qk_norm}: {right}")
    try:
        MLAShape.of(src, rank, rope_frequencies)
    except ValueError as err:
        return str(err)
    return None


def to_mla(model: LlamaModel, rank: int = 0, rope_frequencies: int = 0,
           input_moments: list[torch.Tensor] | None = None) -> tuple[LlamaModel, list[float]]:
    """The model with MLA layers converted from its K/V projections; and each layer's relative error.
    `input_moments` (per layer, sum of x x^T of its attention's inputs) makes the SVD activation-aware."""
    src = model.config
    why = latent_refusal(src, rank, rope_frequencies)
    if why:
        raise ValueError(why)
    shape = MLAShape.of(src, rank, rope_frequencies)
    dst = replace(src, attention_kind="mla", n_kv_heads=src.n_heads, kv_latent_dim=shape.rank,
                  rope_head_dim=shape.rope_dim)
    rotary_freq = source_inv_freq(src)[:shape.kept_pairs].repeat(src.n_kv_heads)   # (d_R / 2,): w_0..w_{f-1} per block
    rope = RotaryEmbedding(shape.rope_dim, src.max_seq_len, src.rope_base, explicit_inv_freq=rotary_freq)
    errors: list[float] = []

    def convert(i: int, old: SelfAttention) -> MultiHeadLatentAttention:
        new, error = convert_layer(old, src, dst, shape, i, None if input_moments is None else input_moments[i])
        errors.append(error)
        return new

    return with_new_attention(model, dst, convert, rope), errors


class LatentKV(ModelVariant):
    name = "mla"
    config_class = MLAConfig
    exact = False                      # low rank and position-free dims change the model's outputs
    # the kit's check, on the tiny random model: the defaults (full rank, all of RoPE) are lossless,
    # so a rank and rotary width that approximate; ratio 1.67 measured (1.38 before random embeddings
    # became a small share of the residual stream, issue 27: attention then carries more of the output)
    quality = QualityBound(max_ratio=1.95, num_tokens=96, config={"rank": 16, "rope_frequencies": 4})
    reported_stats = (
        Stat("kv_latent_dim", "latent width d_c cached per token", "count", table="Model variant"),
        Stat("rope_head_dim", "rotary key width d_R cached per token", "count", table="Model variant"),
        Stat("svd_relative_error", "relative error of the low-rank K/V projections, mean over layers (see low_rank)",
             "fraction", table="Model variant"),
    )

    def __init__(self, config: MLAConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self._stats = {"kv_latent_dim": 0, "rope_head_dim": 0, "svd_relative_error": float("nan")}

    @classmethod
    def refusal(cls, config: MLAConfig, model: ModelConfig) -> str | None:
        return latent_refusal(model, config.rank, config.rope_frequencies)

    def apply(self, model: LlamaModel) -> LlamaModel:
        moments = None
        if self.config.calibration_tokens:
            tokens = calibration_token_ids(model, self.config.calibration_tokens)
            moments = attention_input_moments(model, tokens)
        converted, errors = to_mla(model, self.config.rank, self.config.rope_frequencies, moments)
        cfg = converted.config
        self._stats = {"kv_latent_dim": cfg.kv_latent_dim, "rope_head_dim": cfg.rope_head_dim,
                       "svd_relative_error": sum(errors) / len(errors)}
        return converted

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
