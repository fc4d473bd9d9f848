"""Local Hugging Face checkpoint directories: `config.json` plus `*.safetensors` (never pickle).

Llama, Mistral and Qwen2 share one decoder layout; they differ in what config.json turns on:
Qwen2 has biases on Q, K and V, Mistral, Phi-3, Qwen2/3 and Gemma may declare a sliding window
(applied: a windowed layer's query at position p sees keys p - sliding_window + 1 .. p, on the
layers config.json names, see `window_fields`), and Llama 3.1+ may declare "llama3" RoPE scaling
(applied, see `RotaryEmbedding`). Gemma 2 and 3: ablate.checkpoints.gemma.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ablate.checkpoints.deepseek import DEEPSEEK_MODEL_TYPES, NO_MLA, deepseek_fields, rope_is_interleaved
from ablate.checkpoints.experts import MOE_MODEL_TYPES, moe_fields
from ablate.checkpoints.gemma import GEMMA_MODEL_TYPES, NO_GEMMA, GemmaConfigError, gemma_fields
from ablate.checkpoints.lazy import LazyTensors

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3", *DEEPSEEK_MODEL_TYPES, *MOE_MODEL_TYPES,
                         *GEMMA_MODEL_TYPES)
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or does not match the model it declares."""


# config.json keys the model's shape cannot do without (the others have defaults)
REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def read_json(path: Path) -> Any:
    """A JSON file, or a CheckpointError naming it and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read: {err}") from None
    if not text.strip():
        raise CheckpointError(f"{path}: the file is empty (expected a JSON object)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face checkpoint directory)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{directory}: model_type {model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    missing = [key for key in REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)} (a Hugging Face model config.json "
                              f"declares {', '.join(REQUIRED_KEYS)})")
    for key in (*REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise CheckpointError(f"{path}: {key} must be a whole number > 0, got {value!r}")
    for key in ("rope_theta", "rms_norm_eps"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise CheckpointError(f"{path}: {key} must be a finite number > 0, got {value!r}")
    return config


def _rope_settings(config: dict[str, Any], directory: Path) -> tuple[float, dict[str, float] | None]:
    """(theta, llama3 scaling or None). transformers 5 writes `rope_parameters` (theta included),
    older versions `rope_theta` and `rope_scaling` side by side."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta", params.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rotary = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    if rotary != 1.0:
        raise CheckpointError(f"{directory}: RoPE over part of each head (partial_rotary_factor={rotary}) is not "
                              "supported (only 1.0: every dimension rotated)")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{directory}: RoPE scaling {rope_type!r} is not supported (only 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise CheckpointError(f"{directory}: llama3 RoPE scaling lacks {missing}")
    return theta, {k: float(params[k]) for k in _LLAMA3_KEYS}


def hf_model_fields(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelConfig fields, notes) from config.json.

    `max_seq_len` in the fields is the checkpoint's context length (max_position_embeddings); the
    notes record what was read but is no field: the stored dtype (and what the loader folds into
    the weights as it reads them: Gemma's query_pre_attn_scalar, DeepSeek's interleaved RoPE).
    """
    directory = Path(directory)
    return config_fields(read_hf_config(directory), directory)


def config_fields(config: dict[str, Any], directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """hf_model_fields of a config.json already read (or of the one a GGUF's metadata stands for:
    ablate.checkpoints.gguf_metadata); `directory` is what every message names: the checkpoint
    directory, or the .gguf file."""
    model_type = config["model_type"]
    gemma = model_type in GEMMA_MODEL_TYPES        # GeGLU and more: ablate.checkpoints.gemma
    if not gemma and config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{directory}: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    if config.get("mlp_bias") or (model_type not in ("qwen2", "qwen2_moe") and config.get("attention_bias")):
        raise CheckpointError(f"{directory}: attention_bias/mlp_bias are not supported for {model_type}")
    d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    deepseek = model_type in DEEPSEEK_MODEL_TYPES     # MLA, its own RoPE settings: ablate.checkpoints.deepseek
    # Gemma 3 writes RoPE settings per kind of layer (gemma_fields reads them)
    theta, llama3 = (10_000.0, None) if deepseek or model_type == "gemma3_text" else _rope_settings(config, directory)
    fields = dict(
        n_layers=int(config["num_hidden_layers"]),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or d_model // n_heads),
        d_ff=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        rope_base=theta,
        rope_llama3_scaling=llama3,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(config.get("qkv_bias", True))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
    )
    fields |= deepseek_fields(config, directory) if deepseek else NO_MLA    # a preset's MLA fields never stay
    try:
        fields |= gemma_fields(config, directory) if gemma else NO_GEMMA      # a preset's Gemma fields never stay
    except GemmaConfigError as err:
        raise CheckpointError(str(err)) from None
    fields |= window_fields(config, directory)
    if model_type in MOE_MODEL_TYPES:       # routed (and shared) experts: ablate.checkpoints.experts
        fields |= moe_fields(config, directory)
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    notes = {
        "format": "hf", "path": str(directory), "model_type": model_type,
        "checkpoint_dtype": _DTYPE_NAMES.get(str(stored).removeprefix("torch."), str(stored)),
    }
    if gemma:           # the loader folds the query scale into the weights (ablate.checkpoints.gemma)
        notes["query_pre_attn_scalar"] = float(config.get("query_pre_attn_scalar") or fields["head_dim"])
    if deepseek:        # the loader turns interleaved rotary rows into halves (ablate.checkpoints.deepseek)
        notes["rope_interleaved"] = rope_is_interleaved(config)
    return fields, notes


# model_type -> how its layers slide: every layer when sliding_window is set (Mistral, Phi-3), the
# layers layer_types names (else those from max_window_layers on) when use_sliding_window (Qwen2/3),
# the layers layer_types names (else every other one: Gemma 2; five of six: Gemma 3) (Gemma)
_ALL_LAYERS_SLIDE = ("mistral", "phi3")
_USE_SLIDING_WINDOW = ("qwen2", "qwen3")


def window_fields(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """sliding_window and window_layers (ModelConfig) as transformers applies config.json's windows."""
    model_type, n_layers = config["model_type"], int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if model_type in _USE_SLIDING_WINDOW and not config.get("use_sliding_window"):
        window = None
    if model_type not in (*_ALL_LAYERS_SLIDE, *_USE_SLIDING_WINDOW, *GEMMA_MODEL_TYPES) or window is None:
        return {"sliding_window": 0, "window_layers": None}
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CheckpointError(f"{directory}: sliding_window must be a whole number > 0 or null, "
                              f"got {window!r}")
    if model_type in _ALL_LAYERS_SLIDE:
        return {"sliding_window": window, "window_layers": None}
    layer_types = config.get("layer_types")
    if layer_types is None:
        if model_type in _USE_SLIDING_WINDOW:
            layer_types = ["sliding_attention" if i >= int(config.get("max_window_layers", 28)) else "full_attention"
                           for i in range(n_layers)]
        else:
            every = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    known = ("sliding_attention", "full_attention")
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or any(t not in known for t in layer_types):
        raise CheckpointError(f"{directory}: layer_types must list {n_layers} values, each one of "
                              f"{', '.join(known)}; got {layer_types!r}")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return {"sliding_window": window if sliding else 0, "window_layers": sliding if sliding else None}


def safetensors_files(directory: str | os.PathLike) -> tuple[list[Path], dict[str, str]]:
    """(shard files, tensor name -> file name from the index, or {} for an unsharded checkpoint)."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map (tensor name -> shard file) in it")
        return [directory / name for name in sorted(set(weight_map.values()))], weight_map
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (pickled .bin checkpoints are not read)")
    return files, {}


def hf_state_dict(directory: str | os.PathLike) -> tuple[LazyTensors, dict[str, Path]]:
    """(every tensor by its Hugging Face name, the file each is in). The tensors are read from their
    file only when looked up (ablate.checkpoints.lazy), each checked to be finite then: the files'
    headers are read here, never the whole checkpoint into host memory."""
    from safetensors import SafetensorError, safe_open

    files, weight_map = safetensors_files(directory)
    handles: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} does not exist")
        try:
            handles[str(path)] = handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e
        origin.update(dict.fromkeys(names, path))
    for name, file in weight_map.items():
        if name not in origin:
            raise CheckpointError(f"{Path(directory) / file}: missing tensor {name!r} (listed in {INDEX_FILE})")

    def read(name: str) -> torch.Tensor:
        path = origin[name]
        try:
            tensor = handles[str(path)].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
        check_finite({name: tensor}, path)
        return tensor

    return LazyTensors(read, list(origin)), origin


def check_finite(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """A CheckpointError naming the file and the tensor when a floating-point tensor holds NaN or
    infinite values: the model would run and print garbage."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{path}: tensor {name!r} holds {bad} NaN or infinite value(s) of "
                                  f"{tensor.numel()}: the checkpoint is corrupt (or was saved after training diverged)")
