"""The config.json a GGUF's metadata stands for, one function per llama.cpp architecture: the
`{arch}.` keys of gguf.Keys read back into the Hugging Face fields convert_hf_to_gguf.py wrote them
from (ablate.checkpoints.hf then reads that config as a directory's; gguf_families has the tensors).

What llama.cpp fixes rather than reads is fixed here as llama.cpp fixes it, so that a file means
what it means to llama.cpp: Gemma's query scale 1/sqrt(head_dim) (d_model / n_heads for the 27B
models), Gemma 3's local RoPE base 10 000 and one full layer in six, Qwen2-MoE's top-k weights taken
as they are and Qwen3-MoE's renormalised, every Qwen MoE layer sparse, and DeepSeek's two YaRN
mscales equal (it keeps one).
"""
from __future__ import annotations

from typing import Any

import gguf

from ablate.checkpoints.gguf_file import GGUFError, GGUFFile


class Meta:
    """`{arch}.key` metadata of one file, each missing required key a GGUFError naming it."""

    def __init__(self, gf: GGUFFile) -> None:
        self.gf, self.arch = gf, gf.architecture

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.gf.metadata

    def need(self, key: str) -> Any:
        if not self.has(key):
            raise GGUFError(f"{self.gf.path}: missing metadata key '{self.arch}.{key}'")
        return self.gf.metadata[f"{self.arch}.{key}"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.gf.metadata.get(f"{self.arch}.{key}", default)


# the RoPE scalings each architecture's config reads back (Gemma 3's full layers, DeepSeek's YaRN)
_ROPE_SCALINGS = {"gemma3": ("none", "linear"), "deepseek2": ("none", "yarn")}


def _common(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    """The Llama-family config.json keys every architecture writes (gguf.Keys.LLM / Attention / Rope)."""
    d_model, n_heads = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", d_model // n_heads))
    rotary = int(m.get("rope.dimension_count", head_dim))
    if rotary != head_dim and gf.architecture != "deepseek2":
        raise GGUFError(f"{gf.path}: partial rotary embeddings ({m.arch}.rope.dimension_count={rotary}, "
                        f"head_dim={head_dim}) are not supported")
    scaling = m.get("rope.scaling.type") or "none"
    allowed = _ROPE_SCALINGS.get(gf.architecture, ("none",))
    if "rope_freqs.weight" in gf.tensors or scaling not in allowed:
        raise GGUFError(f"{gf.path}: RoPE frequency scaling in a GGUF (tensor 'rope_freqs.weight' or "
                        f"{m.arch}.rope.scaling.type={scaling!r}) is not supported for {m.arch} (only "
                        f"{' or '.join(allowed)}); load the Hugging Face checkpoint instead")
    vocab = (gf.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in gf.tensors
             else len(gf.metadata.get("tokenizer.ggml.tokens", ())) or int(m.need("vocab_size")))
    return dict(
        num_hidden_layers=int(m.need("block_count")), hidden_size=d_model, num_attention_heads=n_heads,
        num_key_value_heads=int(m.get("attention.head_count_kv", n_heads)), head_dim=head_dim,
        intermediate_size=int(m.get("feed_forward_length", 0)) or _expert_width(m), vocab_size=vocab,
        rope_theta=float(m.get("rope.freq_base", 10_000.0)), rms_norm_eps=float(m.need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in gf.tensors,
        max_position_embeddings=int(m.get("context_length", 2048)),
    )


def _expert_width(m: Meta) -> int:
    return int(m.need("expert_feed_forward_length"))


def _experts(m: Meta) -> dict[str, Any]:
    return dict(num_experts=int(m.need("expert_count")), num_experts_per_tok=int(m.need("expert_used_count")))


def llama(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    config = _common(gf, m)
    if int(m.get("expert_count", 0)):      # Mixtral: the llama writer with experts
        experts = _experts(m)
        return config | dict(model_type="mixtral", num_local_experts=experts["num_experts"],
                             num_experts_per_tok=experts["num_experts_per_tok"],
                             intermediate_size=gf.tensor_info("blk.0.ffn_gate_exps.weight").shape[1])
    return config | dict(model_type="llama")


def qwen2(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    return _common(gf, m) | dict(model_type="qwen2")


def qwen3(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    return _common(gf, m) | dict(model_type="qwen3")


def phi3(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    return _common(gf, m) | dict(model_type="phi3", sliding_window=int(m.get("attention.sliding_window", 0)) or None)


def _gemma(gf: GGUFFile, m: Meta, model_type: str, big_layers: int) -> dict[str, Any]:
    config = _common(gf, m)
    # llama.cpp's query scale: 1/sqrt(head_dim), but 1/sqrt(d_model / n_heads) for the 27B models
    # (which it knows by their layer count)
    scalar = (config["hidden_size"] // config["num_attention_heads"] if config["num_hidden_layers"] == big_layers
              else config["head_dim"])
    return config | dict(model_type=model_type, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                         sliding_window=int(m.need("attention.sliding_window")))


def gemma2(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    return _gemma(gf, m, "gemma2", big_layers=46) | dict(
        attn_logit_softcapping=float(m.get("attn_logit_softcapping", 0.0)) or None,
        final_logit_softcapping=float(m.get("final_logit_softcapping", 0.0)) or None)


def gemma3(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    config = _gemma(gf, m, "gemma3_text", big_layers=62)
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if m.get("rope.scaling.type") == "linear":
        full |= {"rope_type": "linear", "factor": float(m.need("rope.scaling.factor"))}
    n = config["num_hidden_layers"]
    return config | dict(
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])


def qwen2moe(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    shared = int(m.get("expert_shared_feed_forward_length", 0))
    return _common(gf, m) | _experts(m) | dict(
        model_type="qwen2_moe", moe_intermediate_size=_expert_width(m), shared_expert_intermediate_size=shared,
        norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1)


def qwen3moe(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    return _common(gf, m) | _experts(m) | dict(
        model_type="qwen3_moe", moe_intermediate_size=_expert_width(m), norm_topk_prob=True,
        mlp_only_layers=[], decoder_sparse_step=1)


def deepseek2(gf: GGUFFile, m: Meta) -> dict[str, Any]:
    """DeepSeek-V2, V2-Lite and V3 (llama.cpp writes all three as deepseek2): V3 is the one whose
    experts are chosen by sigmoid scores plus a bias (exp_probs_b)."""
    config = _common(gf, m)
    rope = int(m.need("rope.dimension_count"))
    key, value = (int(m.need("attention.key_length_mla")), int(m.need("attention.value_length_mla"))) \
        if m.has("attention.key_length_mla") else (int(m.need("attention.key_length")), int(m.need("attention.value_length")))
    v3 = (int(m.get("expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX)) == gguf.ExpertGatingFuncType.SIGMOID
          or any(name.endswith(".exp_probs_b.bias") for name in gf.tensors))
    groups, used_groups = int(m.get("expert_group_count", 1)), int(m.get("expert_group_used_count", 1))
    experts = int(m.get("expert_count", 0))
    config |= dict(
        model_type="deepseek_v3" if v3 else "deepseek_v2", num_key_value_heads=config["num_attention_heads"],
        q_lora_rank=int(m.get("attention.q_lora_rank", 0)) or None, kv_lora_rank=int(m.need("attention.kv_lora_rank")),
        qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value, rope_interleave=True,
        first_k_dense_replace=int(m.get("leading_dense_block_count", config["num_hidden_layers"] if not experts else 0)),
    )
    config.pop("head_dim")
    if experts:
        config |= dict(
            n_routed_experts=experts, num_experts_per_tok=int(m.need("expert_used_count")),
            moe_intermediate_size=_expert_width(m), n_shared_experts=int(m.get("expert_shared_count", 0)),
            routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)), n_group=groups, topk_group=used_groups,
            norm_topk_prob=bool(m.get("expert_weights_norm", False)) if v3 else False,
            topk_method="noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"))
    if m.get("rope.scaling.type") == "yarn":
        # llama.cpp keeps one mscale (0.1 mscale_all_dim as yarn_log_multiplier): DeepSeek's two are equal
        mscale = float(m.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(m.need("rope.scaling.factor")), "mscale": mscale,
            "mscale_all_dim": mscale, "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length")),
            "beta_fast": float(m.get("rope.scaling.yarn_beta_fast", 32.0)), "beta_slow": float(m.get("rope.scaling.yarn_beta_slow", 1.0)),
            "rope_theta": config["rope_theta"]}
    return config
