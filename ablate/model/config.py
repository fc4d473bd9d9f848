"""Model shapes: one dataclass (the named presets: ablate/model/presets.py).

The engine takes plain dataclasses; the CLI stores each preset in Hydra's ConfigStore under the
`model` group, so `model=smollm2-135m` picks one and `model.n_kv_heads=1` edits it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ablate.api.kv import kv_bytes_per_token
from ablate.api.packing import LayerAttention
from ablate.model.config_checks import check_experts, check_gemma_features, check_routing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# what model.rope_yarn_scaling holds (ablate.model.rope.yarn_inv_freq reads the first four)
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "softmax_mscale")
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
    # mixture of experts (ablate/model/moe.py; Mixtral, Qwen2-MoE, Qwen3-MoE): a layer's SwiGLU MLP
    # replaced by n_experts routed SwiGLU experts of which each token uses n_experts_per_token (top-k
    # of a softmax router), plus optionally a shared expert every token uses. 0 experts: dense.
    n_experts: int = 0                 # routed experts per MoE layer (E); 0: every layer dense
    n_experts_per_token: int = 0       # experts each token is routed to (k)
    expert_d_ff: int = 0               # each routed expert's SwiGLU width; 0: d_ff
    shared_expert_d_ff: int = 0        # a shared expert's SwiGLU width beside the routed ones; 0: none
    shared_expert_gate: bool = False   # Qwen2-MoE: the shared expert's output x sigmoid(w . x), one weight row
    norm_topk_prob: bool = True        # the k routing weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    dense_layers: list[int] | None = None   # MoE models: layers that keep the dense SwiGLU of d_ff (None: none)
    # DeepSeek's routing (ablate/model/deepseek_moe.py): softmax = the top-k above; deepseek_v2 (softmax
    # scores) or deepseek_v3 (sigmoid scores, chosen with a learnt per-expert bias): top-k within the
    # best moe_topk_groups of moe_groups equal groups of experts (0: no groups), weights x routed_scaling
    moe_router: str = "softmax"
    moe_groups: int = 0
    moe_topk_groups: int = 0
    routed_scaling: float = 1.0
    vocab_size: int = 256
    rope_base: float = 10_000.0        # RoPE frequency base theta
    # Llama 3.1+ long-context RoPE (Hugging Face's rope_type "llama3"): None = off, else the keys
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_llama3_scaling: dict[str, float] | None = None
    norm_eps: float = 1e-5             # RMSNorm epsilon
    tied_embeddings: bool = True       # LM head shares the token embedding matrix
    qkv_bias: bool = False             # Qwen2 has biases on the Q, K, V projections
    qk_norm: bool = False              # Qwen3: an RMSNorm over each head's q and k (head_dim), before RoPE
    # Gemma 2 and 3 (off for the other families): embeddings x sqrt(d_model) in the model's dtype; an
    # RMSNorm on the attention's and the MLP's outputs too, before each residual add (post_norms); the
    # MLP's gate through GELU's tanh approximation rather than SiLU
    scale_embeddings: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"       # silu | gelu_tanh
    attn_softcap: float = 0.0          # scaled scores -> c tanh(scores / c) before the mask; 0: off (Gemma 2: 50)
    final_softcap: float = 0.0         # logits -> c tanh(logits / c); 0: off (Gemma 2: 30)
    # sliding-window attention: a windowed layer's query at position p sees keys p - sliding_window + 1 .. p
    sliding_window: int = 0            # 0: every layer attends to the whole sequence
    window_layers: list[int] | None = None   # the layers that slide (None: every layer, when sliding_window > 0)
    rope_local_base: float = 0.0       # RoPE theta of the windowed layers (Gemma 3: 10k); 0: rope_base
    rope_linear_factor: float = 1.0    # RoPE positions / factor in the other layers (Gemma 3's "linear" scaling)
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
    # DeepSeek-V2/V3's MLA (mla only; the defaults are the form variant=mla converts a Llama into):
    q_lora_rank: int = 0               # width of the compressed query c_Q (d_c'); 0: a full W_Q (V2-Lite)
    v_head_dim: int = 0                # value width per head; 0: head_dim (the content q/k width)
    latent_norms: bool = False         # an RMSNorm on the KV latent c (and on c_Q), before it is cached
    # YaRN RoPE (Hugging Face's rope_type "yarn"): None = off, else the keys factor,
    # original_max_position_embeddings, beta_fast, beta_slow, attention_factor (cos and sin are
    # multiplied by it) and softmax_mscale (MLA's score scale is multiplied by it: DeepSeek's mscale^2)
    rope_yarn_scaling: dict[str, float] | None = None

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
        for name in ("rope_llama3_scaling", "rope_yarn_scaling"):
            for key, value in (getattr(self, name) or {}).items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                    raise ValueError(f"model.{name}.{key} must be a finite number > 0, got {value!r}")
        if self.rope_yarn_scaling is not None and (self.rope_llama3_scaling or set(YARN_KEYS) - set(self.rope_yarn_scaling)):
            raise ValueError(f"model.rope_yarn_scaling needs the keys {', '.join(YARN_KEYS)}, and no "
                             "model.rope_llama3_scaling beside it (one RoPE scaling)")
        if self.seed < 0:
            raise ValueError(f"model.seed must be >= 0, got {self.seed}")
        self._resolve_init()
        self._check_attention_kind()
        check_gemma_features(self)
        check_experts(self)
        check_routing(self)

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
        if not isinstance(self.latent_norms, bool):      # before it is read as a truth value
            raise ValueError(f"model.latent_norms must be true or false, got {self.latent_norms!r}")
        if self.attention_kind == "mha":
            if self.kv_latent_dim or self.rope_head_dim or self.q_lora_rank or self.v_head_dim or self.latent_norms:
                raise ValueError("model.kv_latent_dim, rope_head_dim, q_lora_rank, v_head_dim and latent_norms are "
                                 "MLA's; with model.attention_kind=mha set them to 0 (latent_norms to false)")
            return
        if self.q_lora_rank < 0 or self.v_head_dim < 0:
            raise ValueError(f"model.q_lora_rank and model.v_head_dim must be >= 0 (0: a full W_Q; head_dim), "
                             f"got {self.q_lora_rank} and {self.v_head_dim}")
        if self.kv_latent_dim <= 0 or self.rope_head_dim <= 0 or self.rope_head_dim % 2:
            raise ValueError(f"model.attention_kind=mla needs model.kv_latent_dim > 0 and an even model.rope_head_dim "
                             f"> 0, got {self.kv_latent_dim} and {self.rope_head_dim}")
        if self.n_kv_heads != self.n_heads:   # every query head gets its own K and V from the latent
            raise ValueError(f"model.attention_kind=mla needs model.n_kv_heads == model.n_heads ({self.n_heads}), "
                             f"got {self.n_kv_heads}")
        if self.qkv_bias or self.qk_norm or self.architecture != "llama":
            raise ValueError("model.attention_kind=mla supports Llama-family models without Q/K/V biases or norms")

    @property
    def value_head_dim(self) -> int:
        """Width of each head's value (and of its attention output): v_head_dim when set (MLA), else head_dim."""
        return self.v_head_dim or self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The window of `layer` (its query at position p sees keys p - window + 1 .. p), or None: full."""
        if not self.sliding_window or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window

    def layer_subset(self, layers: list[int], name: str) -> ModelConfig:
        """The config of a model that runs only `layers` of this one, in order (a self-speculative
        draft): the fields that name layers by index (window_layers, dense_layers) renumbered, so its
        layer i is what layer layers[i] is here."""
        def renumbered(indices: list[int] | None) -> list[int] | None:
            return None if indices is None else [new for new, old in enumerate(layers) if old in indices]
        return replace(self, n_layers=len(layers), window_layers=renumbered(self.window_layers),
                       dense_layers=renumbered(self.dense_layers), name=name)

    def layer_attention(self, layer: int) -> LayerAttention | None:
        """What `layer`'s attention adds to the plain one (window, soft-cap), or None: plain."""
        window, softcap = self.layer_window(layer), self.attn_softcap or None
        return LayerAttention(window, softcap) if window is not None or softcap is not None else None

    def kv_bytes_at(self, num_tokens: int, element_bytes: int | None = None) -> int:
        """K/V bytes one sequence of num_tokens tokens needs: every layer's K/V of every token, but a
        windowed layer's of its last sliding_window tokens only (sum over layers of min(n, window)).
        Equal to num_tokens x kv_bytes_per_token without windows."""
        per_layer = self.kv_bytes_per_token(element_bytes) // self.n_layers
        window = (self.layer_window(layer) for layer in range(self.n_layers))
        return per_layer * sum(min(num_tokens, w) if w else num_tokens for w in window)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else the dense SwiGLU of d_ff)."""
        return self.n_experts > 0 and layer not in (self.dense_layers or ())

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def moe_params(self, experts: int) -> int:
        """One MoE layer's parameters with `experts` of its routed experts counted: the router (E x d;
        DeepSeek-V3's score bias, E), those experts' SwiGLU (3 d F_e each), the shared expert (3 d F_s)
        and its gate row (d)."""
        d, routed = self.d_model, self.expert_d_ff or self.d_ff
        shared = 3 * d * self.shared_expert_d_ff + (d if self.shared_expert_gate else 0)
        router = self.n_experts * (d + (self.moe_router == "deepseek_v3"))
        return router + experts * 3 * d * routed + shared

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

    def num_params(self, *, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count of the Llama-family decoder with this shape. active: the parameters one
        token uses, which differ for a mixture of experts: of each MoE layer's routed experts only the
        n_experts_per_token it is routed to (the router and a shared expert it uses whole)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        if self.attention_kind == "mla":
            # W_Q (H (d_h + d_R) x d; or W_DQ (d_c' x d) and W_UQ (H (d_h + d_R) x d_c')), W_DKV and W_KR
            # ((d_c + d_R) x d), W_UK (H d_h x d_c), W_UV (H d_v x d_c), W_O (d x H d_v), the latents' norms
            latent, rope, hv, h = self.kv_latent_dim, self.rope_head_dim, self.value_head_dim, self.n_heads
            query = (d + h * (hd + rope)) * self.q_lora_rank if self.q_lora_rank else d * h * (hd + rope)
            norms = (latent + self.q_lora_rank) if self.latent_norms else 0
            attn = query + d * (latent + rope) + h * (hd + hv) * latent + h * hv * d + norms
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = (3 if self.architecture == "llama" else 2) * d * self.d_ff
        per_layer = attn + mlp + (4 if self.post_norms else 2) * d
        body = self.n_layers * per_layer + d
        if self.n_experts:         # an MoE layer holds its experts in place of the dense MLP
            body += self.num_moe_layers * (self.moe_params(self.n_experts_per_token if active else self.n_experts) - mlp)
        embeddings = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return body + (embeddings if include_embeddings else 0)
