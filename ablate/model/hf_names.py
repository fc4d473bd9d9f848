"""Our parameters under Hugging Face's tensor names: a checkpoint's tensors copied into a model.

The names are those of Hugging Face's Llama (`model.layers.0.self_attn.q_proj.weight`...) and the
families that extend it: Phi-3's fused qkv_proj and gate_up_proj (read as they are: ours are fused
alike, rows q, k, v and gate, up), Qwen2's Q/K/V biases, Qwen3's q/k norms, Gemma's four norms per
layer, and the layers that read their own (DeepSeek's MLA: MultiHeadLatentAttention.load_hf; a
mixture of experts: MixtureOfExperts.load_hf).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ablate.model.moe import MixtureOfExperts

if TYPE_CHECKING:
    from ablate.model.llama import LlamaModel


def read_hf_weights(model: LlamaModel, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy (cast) each tensor of `weights` into its rows of `model`, each looked up once: with a lazy
    mapping (ablate.checkpoints.lazy) host memory holds one tensor at a time. A ValueError names
    `source` and the tensor when one is missing or mis-shaped."""
    cfg = model.config
    names = {k.removeprefix("model."): k for k in weights}      # names only: nothing is read yet

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The named tensor, checked against its shape."""
        if name not in names:
            raise ValueError(f"{source}: missing tensor {name!r}")
        t = weights[names[name]]
        if tuple(t.shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def put(param: torch.Tensor, *parts: tuple[str, tuple[int, ...]]) -> None:
        """The named tensors, checked against their shapes, into consecutive rows of `param`."""
        row = 0
        for name, shape in parts:
            param[row:row + shape[0]].copy_(read(name, shape))
            row += shape[0]

    d, hd = cfg.d_model, cfg.head_dim
    qs, kvs = cfg.n_heads * hd, cfg.n_kv_heads * hd
    with torch.no_grad():
        put(model.embed.weight, ("embed_tokens.weight", (cfg.vocab_size, d)))
        for i, layer in enumerate(model.layers):
            pre = f"layers.{i}."
            attn = pre + "self_attn."
            if cfg.attention_kind == "mla":                # DeepSeek-V2/V3's projections, o_proj included
                layer.attn.load_hf(read, attn)
            elif attn + "qkv_proj.weight" in names:        # fused as ours (Phi-3): rows q, k, v
                put(layer.attn.wqkv.weight, (attn + "qkv_proj.weight", (qs + 2 * kvs, d)))
            else:
                put(layer.attn.wqkv.weight, (attn + "q_proj.weight", (qs, d)), (attn + "k_proj.weight", (kvs, d)),
                    (attn + "v_proj.weight", (kvs, d)))
            if cfg.qkv_bias:
                put(layer.attn.wqkv.bias, (attn + "q_proj.bias", (qs,)), (attn + "k_proj.bias", (kvs,)),
                    (attn + "v_proj.bias", (kvs,)))
            if cfg.attention_kind == "mha":
                put(layer.attn.wo.weight, (attn + "o_proj.weight", (d, qs)))
            if cfg.qk_norm:
                put(layer.attn.q_norm.weight, (attn + "q_norm.weight", (hd,)))
                put(layer.attn.k_norm.weight, (attn + "k_norm.weight", (hd,)))
            if isinstance(layer.mlp, MixtureOfExperts):    # Mixtral's, Qwen's or transformers' fused names
                layer.mlp.load_hf(read, names.__contains__, pre)
            else:
                if pre + "mlp.gate_up_proj.weight" in names:   # fused as ours (Phi-3): rows gate, up
                    put(layer.mlp.w_gate_up.weight, (pre + "mlp.gate_up_proj.weight", (2 * cfg.d_ff, d)))
                else:
                    put(layer.mlp.w_gate_up.weight, (pre + "mlp.gate_proj.weight", (cfg.d_ff, d)),
                        (pre + "mlp.up_proj.weight", (cfg.d_ff, d)))
                put(layer.mlp.w_down.weight, (pre + "mlp.down_proj.weight", (d, cfg.d_ff)))
            put(layer.attn_norm.weight, (pre + "input_layernorm.weight", (d,)))
            if cfg.post_norms:       # Gemma: post_attention_layernorm is on the attention's output
                put(layer.attn_post_norm.weight, (pre + "post_attention_layernorm.weight", (d,)))
                put(layer.mlp_norm.weight, (pre + "pre_feedforward_layernorm.weight", (d,)))
                put(layer.mlp_post_norm.weight, (pre + "post_feedforward_layernorm.weight", (d,)))
            else:
                put(layer.mlp_norm.weight, (pre + "post_attention_layernorm.weight", (d,)))
        put(model.norm.weight, ("norm.weight", (d,)))
        if not cfg.tied_embeddings:
            if "lm_head.weight" not in names:
                raise ValueError(f"{source}: missing tensor 'lm_head.weight' (the embeddings are not tied)")
            put(model.lm_head.weight, ("lm_head.weight", (cfg.vocab_size, d)))
