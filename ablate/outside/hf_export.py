"""The experiment's model written as a Hugging Face checkpoint directory (config.json + safetensors), for
an outside engine in another process that loads such directories (vLLM): the same tensors ablate runs,
so its greedy tokens can be compared with ablate's. No tokenizer is written: prompts go as token ids.

Written once per model into ~/.cache/ablate/hf/<name>-<key>/, keyed by what fixes the weights (the
checkpoint file and its modification time, or the random preset's shape and seed) and the dtype."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from ablate.outside.gguf_rewrite import cache_dir
from ablate.outside.hf import hf_state_dict
from ablate.model.llama import LlamaModel

HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def hf_config(model: LlamaModel) -> dict:
    c = model.config
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_attention_heads": c.n_heads, "num_hidden_layers": c.n_layers,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base, "max_position_embeddings": c.max_seq_len, "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tied_embeddings, "torch_dtype": HF_DTYPES[c.dtype],
        "attention_bias": False, "hidden_act": "silu",
    }
    if c.rope_llama3_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", **c.rope_llama3_scaling}
    return config


def hf_directory(model: LlamaModel) -> Path:
    """A checkpoint directory holding `model` (written on first use, then reused)."""
    from safetensors.torch import save_file

    c = model.config
    source = Path(c.path) if c.path else None
    identity = {k: str(v) for k, v in dataclasses.asdict(c).items()}
    if source is not None and source.exists():
        identity["source_mtime_ns"] = str(source.stat().st_mtime_ns)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir("hf") / f"{c.name}-{key}"
    if (target / "config.json").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = hf_state_dict(model)
    if c.tied_embeddings:
        weights.pop("lm_head.weight")           # tied: safetensors refuses two names for one storage
    save_file({k: v.cpu() for k, v in weights.items()}, partial / "model.safetensors")
    (partial / "config.json").write_text(json.dumps(hf_config(model), indent=2))   # last: marks it whole
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
