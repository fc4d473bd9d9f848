"""Small random Hugging Face models of each architecture ablate reads, built offline by transformers.

One builder per kind: the parity tests (tests/test_checkpoints.py and the per-architecture test
files) and benchmarks/model_parity.py load each into ablate from a saved directory and compare its
logits, greedy text and perplexity with transformers' own on the same weights.

Weights are drawn large enough that greedy continuations vary (transformers' 0.02-std init makes
them repeat one token), and norms and biases away from 1 and 0, so that a mis-mapped one shows.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ablate.model.config import ModelConfig

# the shape every kind starts from: two layers, four query heads over two K/V heads
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10_000.0}
# DeepSeek's MLA at a small size: 4 heads, each with its own K/V from a 16-wide latent
DEEPSEEK_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    first_k_dense_replace=64, tie_word_embeddings=False)      # dense up to 64 layers
DEEPSEEK_MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                    n_shared_experts=1, moe_intermediate_size=32)
# YaRN as DeepSeek-V3 declares it, with mscale != mscale_all_dim so both of its scales differ from 1
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10_000.0}


# kind -> (transformers' config class, its causal-LM class, the config's fields beyond SMALL).
# build_hf(kind, **shape) changes the shape (benchmarks/model_parity.py times a wider one)
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=False, rope_theta=10_000.0)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=True, rope_theta=10_000.0)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=False, rope_theta=10_000.0,
                                                          rope_scaling=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64, tie_word_embeddings=False)),
    # Q, K, V in one qkv_proj; gate and up in one gate_up_proj
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # q/k norms per head; a head_dim of its own (not d_model / n_heads)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    # sliding windows of 8 tokens, shorter than the parity tests' prompts: all layers (Mistral), the
    # layers from max_window_layers on (Qwen2)
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                             max_window_layers=1, tie_word_embeddings=False)),
    # Gemma 2: windowed and full layers alternating, soft-capped scores and logits, four norms per
    # layer, GeGLU, a query scale of its own (1/sqrt(query_pre_attn_scalar)), tied embeddings
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=32,
                    attn_logit_softcapping=20.0, final_logit_softcapping=50.0)),
    # Gemma 3: per-head q/k norms, a RoPE base per kind of layer (the full layers' scaled linearly)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=32,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1_000_000.0}})),
    # multi-head latent attention: a compressed query (q_lora_rank) or a full one (V2-Lite), q/k
    # content, rotary and value widths all different; every layer dense (no MoE)
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_MLA | dict(q_lora_rank=24)),
    "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_MLA | dict(q_lora_rank=None)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_MLA | dict(q_lora_rank=24, rope_interleave=True)),
    "deepseek-v3-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                         DEEPSEEK_MLA | dict(q_lora_rank=24, rope_interleave=True, rope_scaling=DEEPSEEK_YARN)),
    # DeepSeek's mixture of experts after one dense layer: 8 experts in 4 groups, 2 a token from the best
    # 2 groups, a shared expert; V2 softmax scores, V3 sigmoid ones renormalised and scaled
    "deepseek-v2-moe": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                        DEEPSEEK_MLA | DEEPSEEK_MOE | dict(q_lora_rank=24, topk_method="group_limited_greedy")),
    "deepseek-v3-moe": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        DEEPSEEK_MLA | DEEPSEEK_MOE | dict(q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # mixtures of experts, 4 experts of which each token takes 2: Mixtral (top-2 renormalised);
    # Qwen2-MoE with a gated shared expert, the top-2 weights as they are, and a dense layer between
    # MoE ones (mlp_only_layers: layer 1 of 4); Qwen3-MoE with q/k norms, the top-2 renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            tie_word_embeddings=False)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                       tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, tie_word_embeddings=False)),
}


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Projections N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.2^2), biases N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)                     # biases, and per-expert or per-channel vectors
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def build_hf(kind: str, seed: int = 0, **shape: Any) -> torch.nn.Module:
    """A random transformers model of `kind` (a key of KINDS), in eval mode; `shape` overrides config
    fields (hidden_size=512, num_hidden_layers=4...)."""
    import transformers

    if kind not in KINDS:
        raise ValueError(f"no random model kind {kind!r}; the kinds are {', '.join(KINDS)}")
    config_class, model_class, fields = KINDS[kind]
    config = getattr(transformers, config_class)(**(SMALL | fields | shape))
    model = getattr(transformers, model_class)(config)
    randomise(model, seed)
    return model.eval()


def pretrained(path: Path) -> ModelConfig:
    """The config that loads the checkpoint at `path` into ablate."""
    from ablate.model.config import ModelConfig
    return ModelConfig(name="checkpoint", init="pretrained", path=str(path))


def random_prompt(length: int, seed: int = 1, vocab_size: int = SMALL["vocab_size"]) -> list[int]:
    """`length` seeded random token ids below vocab_size."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed), device="cpu").tolist()


def greedy(logits_fn, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens: argmax of logits_fn(ids)'s last row (T, V), appended, the whole sequence run again."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits_fn(ids)[-1].argmax()))
    return ids[len(prompt):]


def hf_logits(model: torch.nn.Module):
    """ids -> transformers' logits (T, V) in fp32, for greedy()."""
    @torch.no_grad()
    def run(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device="cpu")).logits[0].float()        # (T, V)
    return run


def save_hf(model: torch.nn.Module, directory: Path, sharded: bool = True) -> Path:
    """save_pretrained into `directory`, in 60 KB shards (an index file and several safetensors) or one file."""
    model.save_pretrained(directory, max_shard_size="60KB" if sharded else "1GB")
    return directory
