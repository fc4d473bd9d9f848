"""Llama-architecture GGUF checkpoints: the model's shape from the header, and its weights named and
laid out as Hugging Face's Llama (ablate/checkpoints/gguf_file.py reads the file itself).

The `llama` writer of llama.cpp permutes the rows of the Q and K projections so that RoPE pairs
become adjacent (the interleaved rotary form); `unpermute_rotary_rows` undoes it for the
rotate-half form our model (and Hugging Face's) uses.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ablate.checkpoints.gguf_file import GGUFError, GGUFFile, read_gguf
from ablate.checkpoints.lazy import LazyTensors
from ablate.model.config import ModelConfig

__all__ = ["GGUFError", "GGUFFile", "expected_shapes", "gguf_model_fields", "gguf_state_dict", "gguf_tensors",
           "hf_name", "read_gguf", "unpermute_rotary_rows"]

EXPECTED_ARCHITECTURE = "llama"

# GGUF tensor name -> Hugging Face Llama name; `{i}` is the layer index
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}



def gguf_model_fields(gf: GGUFFile) -> dict[str, Any]:
    """ModelConfig fields read from a Llama GGUF; `max_seq_len` is the trained context length."""
    if gf.architecture != EXPECTED_ARCHITECTURE:
        raise GGUFError(f"{gf.path}: general.architecture is {gf.architecture!r}, "
                        f"expected {EXPECTED_ARCHITECTURE!r}")
    meta, arch = gf.metadata, EXPECTED_ARCHITECTURE

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{gf.path}: missing metadata key {arch}.{key!r}")
        return meta[f"{arch}.{key}"]

    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // n_heads))
    rotary_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dims != head_dim:
        raise GGUFError(f"{gf.path}: partial rotary embeddings ({arch}.rope.dimension_count={rotary_dims}, "
                        f"head_dim={head_dim}) are not supported")
    experts = int(meta.get(f"{arch}.expert_count", 0))
    if experts:
        raise GGUFError(f"{gf.path}: {arch}.expert_count={experts}: mixture-of-experts GGUF files (Mixtral's) are "
                        "not supported; load the model's Hugging Face checkpoint directory instead")
    if "rope_freqs.weight" in gf.tensors or meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", ""):
        raise GGUFError(f"{gf.path}: RoPE frequency scaling in a GGUF (tensor 'rope_freqs.weight' or "
                        f"{arch}.rope.scaling.type) is not supported; load the Hugging Face checkpoint instead")
    # the embedding matrix is what the weights need; the token list is the fallback
    vocab = (gf.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in gf.tensors
             else len(meta.get("tokenizer.ggml.tokens", ())) or int(need("vocab_size")))
    return dict(
        n_layers=int(need("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(need("feed_forward_length")),
        vocab_size=vocab,
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        rope_llama3_scaling=None,
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in gf.tensors,
        qkv_bias=False,
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama GGUF of this shape holds, with its numpy shape."""
    d, hd, v = cfg.d_model, cfg.head_dim, cfg.vocab_size
    shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (v, d)
    for i in range(cfg.n_layers):
        shapes.update({
            f"blk.{i}.attn_q.weight": (cfg.n_heads * hd, d),
            f"blk.{i}.attn_k.weight": (cfg.n_kv_heads * hd, d),
            f"blk.{i}.attn_v.weight": (cfg.n_kv_heads * hd, d),
            f"blk.{i}.attn_output.weight": (d, cfg.n_heads * hd),
            f"blk.{i}.ffn_gate.weight": (cfg.d_ff, d),
            f"blk.{i}.ffn_up.weight": (cfg.d_ff, d),
            f"blk.{i}.ffn_down.weight": (d, cfg.d_ff),
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.ffn_norm.weight": (d,),
        })
    return shapes


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")          # suffix: weight | bias
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise KeyError(gguf_name)


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation.

    The writer did `w.reshape(n_head, 2, hd/2, dim).swapaxes(1, 2)`: within each head, row r of the
    rotate-half layout (half r // (hd/2), pair r mod hd/2) moved to row 2 (r mod hd/2) + r // (hd/2).
    Reading it back as (n_head, hd/2, 2, dim) and swapping axes 1 and 2 restores the original order.
    """
    rows, dim = w.shape
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, dim).transpose(1, 2).reshape(rows, dim)   # (rows, dim)


def build_order(cfg: ModelConfig) -> list[str]:
    """expected_shapes' tensors in the order LlamaModel.from_hf_state_dict takes them (read ahead so)."""
    shapes = expected_shapes(cfg)
    last = ["output_norm.weight", "output.weight"]
    return [name for name in shapes if name not in last] + [name for name in last if name in shapes]


def gguf_tensors(gf: GGUFFile, cfg: ModelConfig, max_workers: int | None = None) -> LazyTensors:
    """All tensors of a Llama GGUF by their Hugging Face names, each dequantised to fp32 and laid out
    as in Hugging Face's Llama only when it is looked up (ablate.checkpoints.lazy: the next few are
    dequantised ahead in threads), so host memory never holds the whole model in fp32.

    Checks every tensor's presence and shape against `cfg` first, naming the GGUF tensor on error;
    a tensor holding NaN or inf is a GGUFError naming the file and the tensor when it is read.
    """
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        info = gf.tensor_info(name)
        if info.shape != shape:
            raise GGUFError(f"{gf.path}: tensor {name!r} has shape {info.shape}, expected {shape}")
    gguf_names = {hf_name(name): name for name in shapes}

    def convert(hf: str) -> torch.Tensor:
        name = gguf_names[hf]
        w = gf.dequantize(name)                                   # fp32, numpy/torch shape
        if not bool(torch.isfinite(w).all()):      # the model would run and print garbage
            raise GGUFError(f"{gf.path}: tensor {name!r} holds {int((~torch.isfinite(w)).sum())} NaN or infinite "
                            f"value(s) of {w.numel()}: the checkpoint is corrupt")
        if ".attn_q." in name:
            w = unpermute_rotary_rows(w, cfg.n_heads)
        elif ".attn_k." in name:
            w = unpermute_rotary_rows(w, cfg.n_kv_heads)
        return w.contiguous()

    workers = max_workers or min(8, os.cpu_count() or 1)
    return LazyTensors(convert, [hf_name(name) for name in build_order(cfg)], workers)


def gguf_state_dict(gf: GGUFFile, cfg: ModelConfig, max_workers: int | None = None) -> dict[str, torch.Tensor]:
    """gguf_tensors, every tensor read now: a plain dict (for transformers' load_state_dict)."""
    tensors = gguf_tensors(gf, cfg, max_workers)
    try:
        return dict(tensors.items())
    finally:
        tensors.close()
