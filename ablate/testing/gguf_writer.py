"""A transformers model written as an F32 GGUF the way llama.cpp's convert_hf_to_gguf.py writes it,
for the tests: llama.cpp's architecture name, metadata keys (gguf.Keys) and tensor names (the gguf
package's HF -> GGUF name map, as the converter uses it), and the converter's changes to the tensors:

    llama, mistral, mixtral   Q/K rows permuted so that RoPE pairs are adjacent (llama.cpp's NORM rope)
    gemma2, gemma3            every RMSNorm weight stored as 1 + w; no output tensor (tied)
    MoE                       each layer's experts stacked: ffn_{gate,up}_exps (E, F, d), ffn_down_exps (E, d, F)
    deepseek2                 e_score_correction_bias as exp_probs_b.bias; kv_b_proj whole (older
                              converters) or split per head into attn_k_b and attn_v_b (newer ones)

with a minimal SentencePiece-style vocabulary (llama.cpp refuses a file without tokenizer.ggml.*).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# transformers' model_type -> llama.cpp's architecture
ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}
_PERMUTED_QK = ("llama", "mistral", "mixtral")
_GEMMA = ("gemma2", "gemma3_text")


def permute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens, plain pieces, and last <|endoftext|> (llama.cpp's phi3
    looks it up): a llama/SPM vocabulary of vocab_size (> 260) tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab_size - len(tokens) - 1)] + ["<|endoftext|>"]
    kinds = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (vocab_size - 260) + [gguf.TokenType.CONTROL])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab_size)])
    writer.add_token_types([int(k) for k in kinds])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)


def _metadata(writer: gguf.GGUFWriter, config: Any, model_type: str, split_kv_b: bool) -> None:
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = getattr(c, "rope_parameters", None) or {}
    if model_type == "gemma3_text":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    elif model_type.startswith("deepseek"):
        _deepseek_metadata(writer, c, split_kv_b)
        return
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10_000.0)))
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if model_type in _GEMMA:
        writer.add_sliding_window(c.sliding_window)
        if model_type == "gemma2":
            writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if model_type == "phi3" and getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    if model_type == "mixtral":
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _deepseek_metadata(writer: gguf.GGUFWriter, c: Any, split_kv_b: bool) -> None:
    """convert_hf_to_gguf's DeepseekV2Model metadata: the K/V widths of attention over the latent
    (the _mla keys, and K/V heads 1) when kv_b_proj is split into attn_k_b / attn_v_b."""
    writer.add_rope_freq_base((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10_000.0))
    writer.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
    else:
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length(c.v_head_dim)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    writer.add_leading_dense_block_count(min(c.first_k_dense_replace, c.num_hidden_layers))
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_count(c.n_routed_experts or 0)
    writer.add_expert_used_count(c.num_experts_per_tok or 0)
    writer.add_expert_shared_count(c.n_shared_experts or 0)
    writer.add_expert_weights_scale(float(c.routed_scaling_factor))
    v3 = c.model_type == "deepseek_v3"
    writer.add_expert_weights_norm(bool(getattr(c, "norm_topk_prob", False)) and v3)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if getattr(c, "n_group", None):
        writer.add_uint32(gguf.Keys.LLM.EXPERT_GROUP_COUNT.format(arch=writer.arch), c.n_group)
        writer.add_uint32(gguf.Keys.LLM.EXPERT_GROUP_USED_COUNT.format(arch=writer.arch), c.topk_group)
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _tensors(model: torch.nn.Module, model_type: str, split_kv_b: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF name as the converter sees it, tensor with the converter's changes made)."""
    c = model.config
    out = []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):          # transformers' fused (E, 2F, d): stacked halves
            f = t.shape[1] // 2
            stem = name.removesuffix("gate_up_proj")
            out += [(stem + "gate_proj.weight", t[:, :f]), (stem + "up_proj.weight", t[:, f:])]
            continue
        if split_kv_b and name.endswith("kv_b_proj.weight"):    # per head: W_UK^T (d_c, d_h), W_UV (d_v, d_c)
            heads = t.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = heads.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            out += [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
                    (name.replace("kv_b_proj", "v_b_proj"), v_b)]
            continue
        if name.endswith("e_score_correction_bias"):           # the converter's rename, to a .bias
            out.append((name.replace("e_score_correction_bias", "e_score_correction.bias"), t))
            continue
        if name.endswith("mlp.experts.down_proj"):
            out.append((name + ".weight", t))
            continue
        if model_type in _PERMUTED_QK and name.endswith("q_proj.weight"):
            t = permute_rotary_rows(t, c.num_attention_heads)
        elif model_type in _PERMUTED_QK and name.endswith("k_proj.weight"):
            t = permute_rotary_rows(t, c.num_key_value_heads)
        elif model_type in _GEMMA and name.endswith("norm.weight"):
            t = t + 1
        out.append((name, t))
    return out


def write_gguf(model: torch.nn.Module, path: Path, split_kv_b: bool = False,
               edit: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
               vocabulary: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """`model` (a transformers causal LM) as an F32 GGUF at `path`; DeepSeek's kv_b_proj whole
    (attn_kv_b, older converters) or, split_kv_b, as attn_k_b and attn_v_b (newer ones).
    `edit(gguf_name, array)` breaks a file on purpose (the tests of bad input): None leaves the tensor out.
    `vocabulary(writer)` writes the tokenizer.ggml.* keys in place of the minimal vocabulary."""
    config = model.config
    model_type = config.model_type
    arch = ARCHITECTURES[model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"random {model_type}")
    _metadata(writer, config, model_type, split_kv_b)
    if vocabulary is None:
        _tokenizer(writer, config.vocab_size)
    else:
        vocabulary(writer)
    for hf_name, tensor in _tensors(model, model_type, split_kv_b):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"the gguf package maps no {gguf.MODEL_ARCH_NAMES[arch]} tensor to {hf_name!r}")
        array = np.ascontiguousarray(tensor.numpy(), dtype=np.float32)
        if edit is not None and (array := edit(name, array)) is None:
            continue
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

