"""The models a model drafter runs: a separate draft model, or part of the target's own layers.

drafter=draft_model  any preset or checkpoint with the target's vocabulary, loaded once per process.
drafter=early_exit   the target's first N layers, then its final norm and LM head.
drafter=layer_skip   the target's layers 0, m, 2m, ... and its last layer (the first and last layers
                     matter most to the output distribution), then its final norm and LM head.
The last two share the target's weight tensors (no copy); their K/V differs from the target's after
the first skipped layer, so they keep their own cache.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ablate.api.model import PRESETS, LlamaModel, ModelConfig, load_model, preset

_loaded: dict[tuple[str, str], LlamaModel] = {}   # (config, device) -> model: arms and repeats share it


def draft_model_config(name_or_path: str, target: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """A preset by name, or a checkpoint (.gguf file / Hugging Face directory) by path.

    The draft takes the target's init (random / pretrained) and dtype unless `overrides` says
    otherwise; its RoPE table is at least as long as the target's.
    """
    if name_or_path in PRESETS:
        base = PRESETS[name_or_path]
        cfg = preset(name_or_path, init=target.init if (base.package or base.path) else base.init,
                     dtype=target.dtype, max_seq_len=max(base.max_seq_len, target.max_seq_len))
    elif Path(name_or_path).expanduser().exists():
        cfg = replace(target, name=Path(name_or_path).stem, init="pretrained", path=name_or_path, package=None)
    else:
        raise ValueError(f"decoding.draft_model={name_or_path!r} is neither a model preset ({', '.join(sorted(PRESETS))}) "
                         "nor an existing checkpoint path (a .gguf file or a Hugging Face directory)")
    try:
        return replace(cfg, **overrides)
    except TypeError as err:
        raise ValueError(f"decoding.draft_overrides: {err}") from err


def load_draft_model(name_or_path: str, target: LlamaModel, overrides: dict[str, Any]) -> LlamaModel:
    """The draft model, on the target's device, checked to share the target's vocabulary."""
    cfg = draft_model_config(name_or_path, target.config, overrides)
    device = next(target.parameters()).device
    key = (repr(cfg), str(device))
    if key not in _loaded:
        _loaded[key] = load_model(cfg, device)
    model = _loaded[key]
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"decoding.draft_model={name_or_path!r} has a vocabulary of {model.config.vocab_size} tokens but the "
            f"target {target.config.name!r} has {target.config.vocab_size}: a draft must share the target's "
            "vocabulary (its tokens are verified by id)")
    return model


def layer_subset(target: LlamaModel, layers: list[int], label: str) -> LlamaModel:
    """A model that runs only `layers` of the target, in order, then the target's final norm and LM
    head. It shares the target's tensors: built on the meta device, then given them by assignment."""
    cfg = target.config.layer_subset(layers, f"{target.config.name}[{label}]")
    with torch.device("meta"):
        model = LlamaModel(cfg)
    state = {name: t for name, t in target.state_dict().items() if not name.startswith("layers.")}
    for new, old in enumerate(layers):
        state |= {f"layers.{new}.{name}": t for name, t in target.layers[old].state_dict().items()}
    model.load_state_dict(state, assign=True)
    model.rope = target.rope                       # RoPE tables are buffers outside the state dict
    return model.eval()


def early_exit_layers(num_layers: int, exit_layer: int) -> list[int]:
    if not 1 <= exit_layer <= num_layers:
        raise ValueError(f"decoding.exit_layer must be in [1, {num_layers}] (the target's layers), got {exit_layer}")
    return list(range(exit_layer))


def layer_skip_layers(num_layers: int, skip_every: int) -> list[int]:
    """Every m-th layer from the first, and the last."""
    return sorted(set(range(0, num_layers, skip_every)) | {num_layers - 1})
