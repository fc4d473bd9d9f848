"""A new model that shares every weight of a loaded one except the attention modules it replaces.

An experiment shares one loaded model between its arms and applies each arm's variant to it, so a
variant must not change the model in place; copying the embeddings and MLPs as well would double
the memory for nothing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ablate.api.model import Linear, LlamaModel, ModelConfig, RotaryEmbedding


def with_new_attention(model: LlamaModel, cfg: ModelConfig, new_attention: Callable[[int, nn.Module], nn.Module],
                       rope: RotaryEmbedding | None = None) -> LlamaModel:
    """A LlamaModel of shape `cfg` whose layer i attends with new_attention(i, model's layer i
    attention) and shares everything else (embeddings, norms, MLPs, LM head, and RoPE tables unless
    `rope` is given) with `model`. New modules are moved to the model's device and dtype."""
    reference = next(model.parameters())
    with torch.device("meta"):
        new = LlamaModel(cfg)          # the structure only: every module below is replaced by a real one
    new.embed, new.norm, new.lm_head = model.embed, model.norm, model.lm_head
    for i, (layer, old) in enumerate(zip(new.layers, model.layers, strict=True)):
        layer.attn_norm, layer.mlp_norm, layer.mlp = old.attn_norm, old.mlp_norm, old.mlp
        layer.attn_post_norm, layer.mlp_post_norm = old.attn_post_norm, old.mlp_post_norm     # Gemma's; else None
        layer.attn = new_attention(i, old.attn).to(device=reference.device, dtype=reference.dtype)
        if reference.device.type == "cpu" and reference.dtype == torch.float32:   # as LlamaModel.finalize
            for module in layer.attn.modules():
                if isinstance(module, Linear):
                    module.input_major()
    new.rope = model.rope if rope is None else rope.to(device=reference.device)   # tables stay fp32
    new.rope_local = model.rope_local        # Gemma 3's windowed layers' own RoPE, or None
    if hasattr(model, "checkpoint_notes"):
        new.checkpoint_notes = model.checkpoint_notes
    return new.eval()
