"""Local Hugging Face checkpoint directories: `config.json` plus `*.safetensors` (never pickle).

Llama, Mistral and Qwen2 share one decoder layout; they differ in what config.json turns on:
Qwen2 has biases on Q, K and V, Mistral and Qwen2 may declare a sliding window (recorded, not
applied: our attention is full, which equals the sliding window whenever the sequence fits in it),
and Llama 3.1+ may declare "llama3" RoPE scaling (applied, see `RotaryEmbedding`).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ablate.checkpoints.lazy import LazyTensors

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3")
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
    notes record what was read but not applied: the stored dtype and any sliding-window settings.
    """
    directory = Path(directory)
    config = read_hf_config(directory)
    model_type = config["model_type"]
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{directory}: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    if config.get("mlp_bias") or (model_type != "qwen2" and config.get("attention_bias")):
        raise CheckpointError(f"{directory}: attention_bias/mlp_bias are not supported for {model_type}")
    d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    theta, llama3 = _rope_settings(config, directory)
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
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
    )
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    notes = {
        "format": "hf", "path": str(directory), "model_type": model_type,
        "checkpoint_dtype": _DTYPE_NAMES.get(str(stored).removeprefix("torch."), str(stored)),
        "sliding_window": config.get("sliding_window"),
        "use_sliding_window": config.get("use_sliding_window", model_type == "mistral"
                                         and config.get("sliding_window") is not None),
        "max_window_layers": config.get("max_window_layers"),
    }
    return fields, notes


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
