"""What each GGUF architecture of llama.cpp is, as a Hugging Face checkpoint: the config.json its
metadata stands for, and which GGUF tensors make each Hugging Face tensor.

convert_hf_to_gguf.py writes every family with llama.cpp's tensor names (gguf.TENSOR_NAMES) and
metadata keys (gguf.Keys, `{arch}.` in front), and changes some tensors on the way; on read we undo
it and hand ablate's HF readers the tensors they already take:

    llama (and Mixtral)   Q/K rows permuted to interleaved RoPE pairs: unpermuted (gguf.py)
    gemma2, gemma3        every RMSNorm weight stored as 1 + w: 1 subtracted (GemmaWeights adds it back)
    MoE                   each layer's experts stacked into ffn_gate_exps / ffn_up_exps (E, F, d) and
                          ffn_down_exps (E, d, F): joined into transformers' fused gate_up_proj (E, 2F, d)
    phi3                  attn_qkv and ffn_up (gate then up) fused as ours: taken as they are
    deepseek2             interleaved rotary rows, as in DeepSeek's own checkpoint (the loader's
                          HalfSplitRope); kv_b_proj whole (attn_kv_b) or split into attn_k_b (H, d_c, d_h)
                          and attn_v_b (H, d_v, d_c) by newer converters: joined back

The metadata, read back into the config.json it was written from: ablate.checkpoints.gguf_metadata.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import gguf
import torch

from ablate.checkpoints import gguf_metadata as md
from ablate.checkpoints.gguf_file import GGUFError, GGUFFile
from ablate.model.config import ModelConfig

T = gguf.MODEL_TENSOR

# MODEL_TENSOR -> the Hugging Face name ablate's readers take (`{bid}`: the layer), every family alike
# unless its Family overrides it
HF_NAMES: dict[gguf.MODEL_TENSOR, str] = {
    T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head",
    T.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    T.ATTN_Q: "model.layers.{bid}.self_attn.q_proj", T.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    T.ATTN_V: "model.layers.{bid}.self_attn.v_proj", T.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    T.ATTN_QKV: "model.layers.{bid}.self_attn.qkv_proj",
    T.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm", T.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
    T.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    T.ATTN_POST_NORM: "model.layers.{bid}.post_attention_layernorm",
    T.FFN_PRE_NORM: "model.layers.{bid}.pre_feedforward_layernorm",
    T.FFN_POST_NORM: "model.layers.{bid}.post_feedforward_layernorm",
    T.FFN_GATE: "model.layers.{bid}.mlp.gate_proj", T.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    T.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
    T.FFN_GATE_INP: "model.layers.{bid}.mlp.gate",
    T.FFN_DOWN_EXP: "model.layers.{bid}.mlp.experts.down_proj",
    T.FFN_GATE_SHEXP: "model.layers.{bid}.mlp.shared_expert.gate_proj",
    T.FFN_UP_SHEXP: "model.layers.{bid}.mlp.shared_expert.up_proj",
    T.FFN_DOWN_SHEXP: "model.layers.{bid}.mlp.shared_expert.down_proj",
    T.FFN_GATE_INP_SHEXP: "model.layers.{bid}.mlp.shared_expert_gate",
    T.ATTN_Q_A: "model.layers.{bid}.self_attn.q_a_proj", T.ATTN_Q_B: "model.layers.{bid}.self_attn.q_b_proj",
    T.ATTN_Q_A_NORM: "model.layers.{bid}.self_attn.q_a_layernorm",
    T.ATTN_KV_A_MQA: "model.layers.{bid}.self_attn.kv_a_proj_with_mqa",
    T.ATTN_KV_A_NORM: "model.layers.{bid}.self_attn.kv_a_layernorm",
    T.ATTN_KV_B: "model.layers.{bid}.self_attn.kv_b_proj",
}


def gguf_name(tensor: gguf.MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """llama.cpp's name of one tensor: `blk.3.attn_q.weight`."""
    return f"{gguf.TENSOR_NAMES[tensor].format(bid=layer)}.{suffix}"


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor made of GGUF tensors: their names and numpy shapes, and how to make it."""
    gguf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor] | None = None     # None: the one tensor as it is


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    hf_config: Callable[[GGUFFile, md.Meta], dict[str, Any]]    # the config.json the metadata stands for
    norm_shift: float = 0.0            # what the writer added to every RMSNorm weight (Gemma: 1)
    permuted_qk: bool = False          # Q/K rows in llama.cpp's interleaved order (the `llama` writer)
    hf_names: dict[gguf.MODEL_TENSOR, str] = field(default_factory=dict)     # over HF_NAMES

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    def hf(self, tensor: gguf.MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
        if tensor not in gguf.MODEL_TENSORS[self.arch]:       # our table and llama.cpp's must agree
            raise AssertionError(f"{tensor.name} is no tensor of llama.cpp's {self.name}")
        return f"{self.hf_names.get(tensor, HF_NAMES[tensor]).format(bid=layer)}.{suffix}"


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(gguf.MODEL_ARCH.LLAMA, md.llama, permuted_qk=True),
    Family(gguf.MODEL_ARCH.QWEN2, md.qwen2),
    Family(gguf.MODEL_ARCH.QWEN3, md.qwen3),
    Family(gguf.MODEL_ARCH.PHI3, md.phi3, hf_names={T.FFN_UP: "model.layers.{bid}.mlp.gate_up_proj"}),
    Family(gguf.MODEL_ARCH.GEMMA2, md.gemma2, norm_shift=1.0),
    Family(gguf.MODEL_ARCH.GEMMA3, md.gemma3, norm_shift=1.0),
    Family(gguf.MODEL_ARCH.QWEN2MOE, md.qwen2moe),
    Family(gguf.MODEL_ARCH.QWEN3MOE, md.qwen3moe),
    Family(gguf.MODEL_ARCH.DEEPSEEK2, md.deepseek2, hf_names={
        T.FFN_GATE_SHEXP: "model.layers.{bid}.mlp.shared_experts.gate_proj",
        T.FFN_UP_SHEXP: "model.layers.{bid}.mlp.shared_experts.up_proj",
        T.FFN_DOWN_SHEXP: "model.layers.{bid}.mlp.shared_experts.down_proj"}),
)}


def family_of(gf: GGUFFile) -> Family:
    if gf.architecture not in FAMILIES:
        raise GGUFError(f"{gf.path}: general.architecture {gf.architecture!r} is not supported (supported: "
                        f"{', '.join(map(repr, FAMILIES))}); load the model's Hugging Face checkpoint directory instead")
    return FAMILIES[gf.architecture]


def hf_config(gf: GGUFFile) -> dict[str, Any]:
    """The config.json a GGUF's metadata stands for (read by ablate.checkpoints.hf as a directory's would be)."""
    family = family_of(gf)
    return family.hf_config(gf, md.Meta(gf))


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=-2)


def parts(family: Family, cfg: ModelConfig, stored: Collection[str]) -> dict[str, Part]:
    """Hugging Face name -> the GGUF tensors it is made of, for a model of this shape (`stored`: the
    file's tensor names, where a family has two layouts)."""
    d, hd, v = cfg.d_model, cfg.head_dim, cfg.vocab_size
    qs, kvs = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out: dict[str, Part] = {}

    def one(tensor: gguf.MODEL_TENSOR, shape: tuple[int, ...], layer: int | None = None, suffix: str = "weight",
            hf: str | None = None) -> None:
        out[hf or family.hf(tensor, layer, suffix)] = Part((gguf_name(tensor, layer, suffix),), (shape,))

    one(T.TOKEN_EMBD, (v, d))
    for i in range(cfg.n_layers):
        one(T.ATTN_NORM, (d,), i)
        if cfg.attention_kind == "mla":
            _mla_parts(family, cfg, i, out, stored)
        elif family.arch == gguf.MODEL_ARCH.PHI3:                # fused as ours: rows q, k, v
            one(T.ATTN_QKV, (qs + 2 * kvs, d), i)
        else:
            one(T.ATTN_Q, (qs, d), i)
            one(T.ATTN_K, (kvs, d), i)
            one(T.ATTN_V, (kvs, d), i)
        if cfg.qkv_bias:
            for tensor, rows in ((T.ATTN_Q, qs), (T.ATTN_K, kvs), (T.ATTN_V, kvs)):
                one(tensor, (rows,), i, "bias")
        if cfg.attention_kind != "mla":
            one(T.ATTN_OUT, (d, qs), i)
        if cfg.qk_norm:
            one(T.ATTN_Q_NORM, (hd,), i)
            one(T.ATTN_K_NORM, (hd,), i)
        if cfg.post_norms:
            one(T.ATTN_POST_NORM, (d,), i)
            one(T.FFN_PRE_NORM, (d,), i)
            one(T.FFN_POST_NORM, (d,), i)
        else:
            one(T.FFN_NORM, (d,), i)
        if cfg.n_experts and i not in (cfg.dense_layers or ()):
            _expert_parts(family, cfg, i, out)
        elif family.arch == gguf.MODEL_ARCH.PHI3:           # ffn_up holds gate then up
            one(T.FFN_UP, (2 * cfg.d_ff, d), i)
            one(T.FFN_DOWN, (d, cfg.d_ff), i)
        else:
            one(T.FFN_GATE, (cfg.d_ff, d), i)
            one(T.FFN_UP, (cfg.d_ff, d), i)
            one(T.FFN_DOWN, (d, cfg.d_ff), i)
    one(T.OUTPUT_NORM, (d,))
    if not cfg.tied_embeddings:
        one(T.OUTPUT, (v, d))
    return out


def _expert_parts(family: Family, cfg: ModelConfig, i: int, out: dict[str, Part]) -> None:
    e, f, d = cfg.n_experts, cfg.expert_d_ff, cfg.d_model
    out[family.hf(T.FFN_GATE_INP, i)] = Part((gguf_name(T.FFN_GATE_INP, i),), ((e, d),))
    # (E, F, d) gate and (E, F, d) up -> (E, 2F, d): transformers' fused gate_up_proj, ablate's layout
    out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = Part(
        (gguf_name(T.FFN_GATE_EXP, i), gguf_name(T.FFN_UP_EXP, i)), ((e, f, d), (e, f, d)), _cat_rows)
    out[f"model.layers.{i}.mlp.experts.down_proj"] = Part((gguf_name(T.FFN_DOWN_EXP, i),), ((e, d, f),))
    if cfg.shared_expert_d_ff:
        s = cfg.shared_expert_d_ff
        for tensor, shape in ((T.FFN_GATE_SHEXP, (s, d)), (T.FFN_UP_SHEXP, (s, d)), (T.FFN_DOWN_SHEXP, (d, s))):
            out[family.hf(tensor, i)] = Part((gguf_name(tensor, i),), (shape,))
    if cfg.shared_expert_gate:
        out[family.hf(T.FFN_GATE_INP_SHEXP, i)] = Part((gguf_name(T.FFN_GATE_INP_SHEXP, i),), ((1, d),))
    if cfg.moe_router == "deepseek_v3":          # the bias added to the scores when choosing experts
        out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = Part((gguf_name(T.FFN_EXP_PROBS_B, i, "bias"),),
                                                                         ((e,),))


def _mla_parts(family: Family, cfg: ModelConfig, i: int, out: dict[str, Part], stored: Collection[str]) -> None:
    """DeepSeek's multi-head latent attention (ablate/model/mla.py names the widths)."""
    h, d, dh, dr, dv, dc = cfg.n_heads, cfg.d_model, cfg.head_dim, cfg.rope_head_dim, cfg.v_head_dim, cfg.kv_latent_dim

    def one(tensor: gguf.MODEL_TENSOR, shape: tuple[int, ...]) -> None:
        out[family.hf(tensor, i)] = Part((gguf_name(tensor, i),), (shape,))

    if cfg.q_lora_rank:
        one(T.ATTN_Q_A, (cfg.q_lora_rank, d))
        one(T.ATTN_Q_A_NORM, (cfg.q_lora_rank,))
        one(T.ATTN_Q_B, (h * (dh + dr), cfg.q_lora_rank))
    else:
        one(T.ATTN_Q, (h * (dh + dr), d))
    one(T.ATTN_KV_A_MQA, (dc + dr, d))
    one(T.ATTN_KV_A_NORM, (dc,))
    if gguf_name(T.ATTN_K_B, i) in stored:       # newer converters: kv_b_proj split per head
        out[family.hf(T.ATTN_KV_B, i)] = Part((gguf_name(T.ATTN_K_B, i), gguf_name(T.ATTN_V_B, i)),
                                              ((h, dc, dh), (h, dv, dc)), _join_kv_b)
    else:
        one(T.ATTN_KV_B, (h * (dh + dv), dc))
    one(T.ATTN_OUT, (d, h * dv))


def _join_kv_b(parts: list[torch.Tensor]) -> torch.Tensor:
    """attn_k_b (H, d_c, d_h) and attn_v_b (H, d_v, d_c) -> kv_b_proj (H (d_h + d_v), d_c): per head
    W_UK's d_h rows then W_UV's d_v rows."""
    k_b, v_b = parts
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])


def same_shape(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Shapes equal up to leading 1s (ggml pads every shape with 1s: (d,) and (1, d) are one tensor to it)."""
    def trim(shape: tuple[int, ...]) -> tuple[int, ...]:
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]
        return shape
    return trim(tuple(stored)) == trim(tuple(expected))

