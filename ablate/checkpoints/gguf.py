"""GGUF checkpoints of the architectures llama.cpp defines (llama and Mixtral, qwen2, qwen3, phi3,
gemma2, gemma3, qwen2moe, qwen3moe, deepseek2): the model's shape from the header, and its weights
named and laid out as in the Hugging Face checkpoint the file was converted from, so that the HF
readers take them unchanged. What is common lives here (the metadata read as a config.json, every
tensor's presence and shape checked before loading, dequantise-on-demand, NaN/inf named); each
family's peculiarities in ablate/checkpoints/gguf_families.py and gguf_metadata.py; the file itself
in gguf_file.py.

The `llama` writer of llama.cpp permutes the rows of the Q and K projections so that RoPE pairs
become adjacent (the interleaved rotary form); `unpermute_rotary_rows` undoes it for the
rotate-half form our model (and Hugging Face's) uses.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ablate.checkpoints.gguf_families import family_of, hf_config, parts, same_shape
from ablate.checkpoints.gguf_file import GGUFError, GGUFFile, read_gguf
from ablate.checkpoints.hf import CheckpointError, config_fields
from ablate.checkpoints.lazy import LazyTensors
from ablate.model.config import ModelConfig

__all__ = ["GGUFError", "GGUFFile", "expected_shapes", "gguf_model", "gguf_model_fields", "gguf_state_dict",
           "gguf_tensors", "read_gguf", "unpermute_rotary_rows"]


def gguf_model(gf: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelConfig fields, notes) of a GGUF, as of the Hugging Face directory it was converted from:
    its metadata read as that directory's config.json (ablate.checkpoints.gguf_families), the notes
    saying what the loader folds into the weights (Gemma's norms and query scale, DeepSeek's RoPE)."""
    config = hf_config(gf)
    try:
        return config_fields(config, gf.path)
    except CheckpointError as err:
        raise GGUFError(f"{gf.path}: its metadata ({gf.architecture}) asks for what ablate does not run: {err}") from None


def gguf_model_fields(gf: GGUFFile) -> dict[str, Any]:
    """ModelConfig fields read from a GGUF; `max_seq_len` is the trained context length."""
    return gguf_model(gf)[0]


def expected_shapes(gf: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF of this architecture and shape holds, with its numpy shape."""
    return {name: shape for part in parts(family_of(gf), cfg, gf.tensors).values() for name, shape in zip(part.gguf, part.shapes)}


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation.

    The writer did `w.reshape(n_head, 2, hd/2, dim).swapaxes(1, 2)`: within each head, row r of the
    rotate-half layout (half r // (hd/2), pair r mod hd/2) moved to row 2 (r mod hd/2) + r // (hd/2).
    Reading it back as (n_head, hd/2, 2, dim) and swapping axes 1 and 2 restores the original order.
    """
    rows, dim = w.shape
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, dim).transpose(1, 2).reshape(rows, dim)   # (rows, dim)


def gguf_tensors(gf: GGUFFile, cfg: ModelConfig, max_workers: int | None = None) -> LazyTensors:
    """All tensors of a GGUF by their Hugging Face names, each dequantised to fp32 and laid out as in
    the Hugging Face checkpoint it was converted from only when it is looked up (ablate.checkpoints.lazy:
    the next few are dequantised ahead in threads), so host memory never holds the whole model in fp32.

    Checks every tensor's presence and shape against `cfg` first, naming the GGUF tensor on error;
    a tensor holding NaN or inf is a GGUFError naming the file and the tensor when it is read.
    """
    family = family_of(gf)
    table = parts(family, cfg, gf.tensors)
    for part in table.values():
        for name, shape in zip(part.gguf, part.shapes):
            info = gf.tensor_info(name)
            if not same_shape(info.shape, shape):
                raise GGUFError(f"{gf.path}: tensor {name!r} has shape {info.shape}, expected {shape}")

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = gf.dequantize(name).reshape(shape)                     # fp32, numpy/torch shape
        if not bool(torch.isfinite(w).all()):      # the model would run and print garbage
            raise GGUFError(f"{gf.path}: tensor {name!r} holds {int((~torch.isfinite(w)).sum())} NaN or infinite "
                            f"value(s) of {w.numel()}: the checkpoint is corrupt")
        if family.permuted_qk and ".attn_q." in name:
            w = unpermute_rotary_rows(w, cfg.n_heads)
        elif family.permuted_qk and ".attn_k." in name:
            w = unpermute_rotary_rows(w, cfg.n_kv_heads)
        elif family.norm_shift and name.endswith("norm.weight"):
            w = w - family.norm_shift              # the writer's 1 + w; GemmaWeights adds it back
        return w

    def convert(hf: str) -> torch.Tensor:
        part = table[hf]
        tensors = [read(name, shape) for name, shape in zip(part.gguf, part.shapes)]
        return (part.join(tensors) if part.join else tensors[0]).contiguous()

    workers = max_workers or min(8, os.cpu_count() or 1)
    return LazyTensors(convert, list(table), workers)


def gguf_state_dict(gf: GGUFFile, cfg: ModelConfig, max_workers: int | None = None) -> dict[str, torch.Tensor]:
    """gguf_tensors, every tensor read now: a plain dict (for transformers' load_state_dict)."""
    tensors = gguf_tensors(gf, cfg, max_workers)
    try:
        return dict(tensors.items())
    finally:
        tensors.close()
