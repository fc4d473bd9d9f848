"""A Llama-family decoder: RMSNorm, RoPE, SwiGLU, grouped KV heads.

Tokens arrive packed (T, ...) across all sequences of a step; attention and the KV cache are the
engine's slots, reached through the `Forward` of each step (ablate/model/forward.py), so the same weights run under
every technique. Q/K/V and gate/up projections are fused (one matmul each, as in gpt-fast): at
batch 1 the CPU is bandwidth-bound and every extra kernel call costs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ablate.model.config import ModelConfig
from ablate.model import native
from ablate.model.linear import Linear
from ablate.model.mla import MultiHeadLatentAttention
from ablate.model.deepseek_moe import DeepSeekExperts
from ablate.model.hf_names import read_hf_weights
from ablate.model.moe import MixtureOfExperts
from ablate.model.native_plan import NativePlans
from ablate.model.rope import RotaryEmbedding, apply_rope, rotary_embedding

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ablate.model.forward import Forward
    from ablate.model.native_plan import NativeStep


EMBEDDING_STD = 0.02    # random token embeddings (LlamaModel.random): a small share of the residual stream


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(mean(x^2) + eps) * w, normalised in fp32 as the reference implementations do
        if native.takes(x, native.NORM_DTYPES) and self.weight.dtype == x.dtype:   # one pass, not six operations
            return native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size = cfg.n_heads * cfg.head_dim
        self.kv_size = cfg.n_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.d_model, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(self.q_size, cfg.d_model, bias=False)
        # Qwen3: each head's q and k RMS-normalised (one weight per head_dim, shared by the heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.features = cfg.layer_attention(layer)      # a sliding window, soft-capped scores; None: plain

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fwd: Forward) -> torch.Tensor:
        q, k, v = fwd.dense(_project_qkv, self, x, rope)                      # (T, H, D), (T, H_kv, D) x 2
        out = fwd.attend(self.layer, q, fwd.store(self.layer, k, v), self.features)   # (T, H, D)
        return fwd.dense(_project_out, self, out)                             # (T, d)


def _project_qkv(attn: SelfAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    """x (T, d) -> q (T, H, D), k (T, H_kv, D) rotated, v (T, H_kv, D): one fused projection."""
    t = x.shape[0]
    qkv = attn.wqkv(x)                                                       # (T, (H + 2 H_kv) D)
    qk = qkv[:, :attn.q_size + attn.kv_size].view(t, attn.n_heads + attn.n_kv_heads, attn.head_dim)
    if attn.q_norm is not None:                                              # before RoPE, per head
        qk = torch.cat((attn.q_norm(qk[:, :attn.n_heads]), attn.k_norm(qk[:, attn.n_heads:])), dim=1)
    q, k = apply_rope(qk, *rope).split((attn.n_heads, attn.n_kv_heads), dim=1)
    v = qkv[:, attn.q_size + attn.kv_size:].view(t, attn.n_kv_heads, attn.head_dim)
    return q, k, v


def _project_out(attn: SelfAttention, out: torch.Tensor) -> torch.Tensor:
    return attn.wo(out.reshape(out.shape[0], attn.q_size))                    # (T, H, D) -> (T, d)


def _mlp_residual(layer: DecoderLayer, x: torch.Tensor, *experts: str) -> torch.Tensor:
    """experts: a mixture of experts' strategy (engine.moe_experts, ablate/model/moe.py); () for a SwiGLU."""
    out = layer.mlp(layer.mlp_norm(x), *experts)
    return x + (out if layer.mlp_post_norm is None else layer.mlp_post_norm(out))


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): act = SiLU (Llama), or GELU's tanh approximation (Gemma's GeGLU)."""

    def __init__(self, cfg: ModelConfig, d_ff: int = 0) -> None:
        """d_ff: the hidden width, 0 -> cfg.d_ff (a mixture of experts' shared expert has its own)."""
        super().__init__()
        self.d_ff = d_ff or cfg.d_ff
        self.gelu = cfg.mlp_activation == "gelu_tanh"
        self.w_gate_up = Linear(cfg.d_model, 2 * self.d_ff, bias=False)
        self.w_down = Linear(self.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)                                          # (T, 2 F)
        if self.gelu:
            gate, up = gate_up.split(self.d_ff, dim=-1)
            return self.w_down(F.gelu(gate, approximate="tanh") * up)
        if native.takes(gate_up):                                            # one pass, not three operations
            return self.w_down(native.silu_mul(gate_up))
        gate, up = gate_up.split(self.d_ff, dim=-1)
        return self.w_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.attention_kind == "mla":
            self.attn = MultiHeadLatentAttention(cfg, layer)
        else:
            self.attn = SelfAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            shared = SwiGLU(cfg, cfg.shared_expert_d_ff) if cfg.shared_expert_d_ff else None
            experts = MixtureOfExperts if cfg.moe_router == "softmax" else DeepSeekExperts   # DeepSeek's routing
            self.mlp = experts(cfg, shared)
        else:
            self.mlp = SwiGLU(cfg)
        # Gemma: the attention's and the MLP's outputs normalised too, before each residual add
        self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.post_norms else None
        self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.post_norms else None
        # Gemma 3: the windowed layers rotate by a RoPE base of their own
        self.local_rope = bool(cfg.rope_local_base) and cfg.layer_window(layer) is not None
        if self.native_calls_fit():      # the one-row timing weighs its products as they would then run
            for linear in (self.attn.wqkv, self.attn.wo, self.mlp.w_gate_up, self.mlp.w_down):
                linear.in_native_layer = True

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fwd: Forward,
                native_step: NativeStep | None = None) -> torch.Tensor:
        """native_step: the layer's two native calls for this step, where the model's plan runs it so
        (ablate/model/native_plan.py); the layer is called as a module either way, so its hooks see it."""
        if native_step is not None:
            return native_step.forward(x, rope, fwd)
        out = self.attn(self.attn_norm(x), rope, fwd)
        x = x + (out if self.attn_post_norm is None else self.attn_post_norm(out))
        experts = (fwd.moe_experts,) if isinstance(self.mlp, MixtureOfExperts) else ()
        return fwd.dense(_mlp_residual, self, x, *experts)

    def native_calls_fit(self) -> bool:
        """Whether the layer is one the native calls compute (ablate/model/native_plan.py): a plain Llama
        layer (no qk-norm, post-norms, GeGLU, experts or latent attention, as a model variant left it)."""
        attn, mlp = self.attn, self.mlp
        return (type(attn) is SelfAttention and attn.q_norm is None and type(mlp) is SwiGLU and not mlp.gelu
                and self.attn_post_norm is None and type(self.attn_norm) is RMSNorm and type(self.mlp_norm) is RMSNorm)


def _ropes(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """(the RoPE of every layer, or of the full ones; the windowed layers' own, or None). Gemma 3 gives
    its windowed layers a base of their own (rope_local_base) and may scale the other layers' positions
    linearly (rope_linear_factor: p / factor, i.e. every frequency / factor)."""
    rope = rotary_embedding(cfg)
    if cfg.rope_linear_factor != 1.0:
        dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu")    # on the CPU even under meta
        inv_freq = 1.0 / cfg.rope_base ** (dims / cfg.head_dim)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_base,
                               explicit_inv_freq=inv_freq / cfg.rope_linear_factor)
    local = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_base) if cfg.rope_local_base else None
    return rope, local


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.shape_only or cfg.architecture != "llama":
            raise ValueError(
                f"model {cfg.name!r} is shape-only (used by the analytic model and cost calculator); "
                "pick an instantiable preset such as tiny, smollm2-135m, llama-3.2-1b or llama-3-8b"
            )
        self.config = cfg
        # storage given: no init here (weights are set by random() or a checkpoint); on the meta
        # device an init would import torch._dynamo, seconds of start-up
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope, self.rope_local = _ropes(cfg)
        self.native_plans = NativePlans()      # which layers of a step run as native calls

    @torch.inference_mode()
    def forward(self, fwd: Forward) -> torch.Tensor:
        """Packed tokens -> final hidden states (T, d_model)."""
        x = self.embed(fwd.step.input_ids)                 # (T, d)
        if self.config.scale_embeddings:                   # Gemma: x sqrt(d_model), the factor rounded to x's dtype
            x = x * float(torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype, device="cpu"))
        rope = self.rope.tables(fwd.step.positions, x.dtype)
        local = self.rope_local.tables(fwd.step.positions, x.dtype) if self.rope_local is not None else rope
        plan = self.native_plans.for_step(self.layers, x, fwd)
        steps = [None] * len(self.layers)
        if plan is not None:      # the native calls take whole tensors and write each layer's output over x
            x, rope, local = x.contiguous(), tuple(t.contiguous() for t in rope), tuple(t.contiguous() for t in local)
            steps = plan.step(x, rope, local)
        for layer, native_step in zip(self.layers, steps):
            x = layer(x, local if layer.local_rope else rope, fwd, native_step)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()              # (N, vocab) in fp32 for sampling
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits    # Gemma 2: c tanh(logits / c)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> LlamaModel:
        """Uninitialised storage allocated directly on `device` in the model's dtype: no host copy of
        the model, and no time spent on an init that is overwritten. RoPE tables: fp32, on the CPU
        until finalize."""
        with torch.device("meta"):
            model = cls(cfg)
        # its tables are real (built on the CPU): kept out of the cast
        ropes, model.rope, model.rope_local = (model.rope, model.rope_local), None, None
        # on the meta device the cast allocates nothing; to_empty then allocates each tensor once, on `device`
        model = model.to(dtype=cfg.torch_dtype).to_empty(device=device)
        if cfg.tied_embeddings:               # to_empty gives each module its own copy: tie again
            model.lm_head.weight = model.embed.weight
        model.rope, model.rope_local = ropes
        return model

    @classmethod
    def random(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> LlamaModel:
        """Seeded random weights whose greedy text varies, as a trained model's does: a test that
        compares tokens, or a speculative figure, must not pass because every token repeats the last.

        Projections are N(0, 1/fan_in), so every layer adds O(1) per element to the residual stream
        (its input is RMS-normalised) and the stream grows like sqrt(2 x layers); embeddings are
        N(0, 0.02^2), a small share of it, as in trained models. RMSNorm makes the model invariant to
        one common scale of the embeddings and the layers' outputs: the embedding's share of the last
        hidden state is what matters. With a tied head the current token's own logit is raised by
        ~sqrt(d_model) x that share (in units of the logits' spread), and a large share makes a token
        its own argmax forever. Measured by benchmarks/random_weight_text.py, 16 layers at
        llama-3.2-1b's width, 64 greedy tokens: N(0, 1) embeddings with a gain of 4 on wo/w_down
        emitted 1-2 distinct tokens and n-gram drafts were accepted 100%; 0.02 embeddings with the
        residual projections scaled by 1/sqrt(2 x layers) (GPT-2's init, a stream of O(1)) still
        repeated (2-9, 97%); 0.02 with unscaled projections: 23-26 distinct, 16% accepted.

        Each parameter is drawn from one seeded generator, in a fixed order. On the CPU it is drawn in
        fp32 and copied (cast) into its place: the same seed gives the same weights in every dtype (up
        to the cast), and host memory holds one parameter, never the model. On an accelerator it is
        drawn in place, in its dtype, by the device's generator seeded the same: the same weights on
        every such device kind, other values than the CPU's. Drawing llama-3.2-1b's 1.24 B values on
        the host took ~20 s in every process that built it; on the device each draw is one kernel."""
        cfg = cfg.for_device(device)
        on_host = torch.device(device).type == "cpu"
        gen = torch.Generator(torch.device(device)).manual_seed(cfg.seed)
        model = cls.empty(cfg, device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    std = EMBEDDING_STD if p is model.embed.weight else p.shape[-1] ** -0.5   # (..., out, in): 1/sqrt(fan_in)
                    if on_host:
                        p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))
                    else:
                        p.normal_(0.0, std, generator=gen)
        return model.finalize(device)

    @classmethod
    def from_hf_state_dict(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                           device: torch.device | str = "cpu", source: str = "checkpoint") -> LlamaModel:
        """Build from tensors named as in Hugging Face's checkpoints (ablate/model/hf_names.py), allocated
        on `device` in the model's dtype, each tensor copied (cast) into its rows there."""
        cfg = cfg.for_device(device)
        model = cls.empty(cfg, device)
        read_hf_weights(model, weights, source)
        return model.finalize(device)

    def finalize(self, device: torch.device | str) -> LlamaModel:
        """On the device in the configured dtype (nothing moves for a model empty() already put there);
        the RoPE tables stay fp32: the angles of late positions need its precision (tables() casts per step)."""
        for child in self.children():
            if child is not self.rope and child is not self.rope_local:
                child.to(device=device, dtype=self.config.torch_dtype)
        self.rope.to(device=device)
        if self.rope_local is not None:
            self.rope_local.to(device=device)
        # W^T contiguous: MKL's fast fp32 matrix-vector layout (bf16/fp16 products are not MKL's, and
        # PyTorch's own kernels for them are far slower on a transposed weight: keep those as they are)
        if torch.device(device).type == "cpu" and self.config.torch_dtype == torch.float32:
            for module in self.modules():
                if isinstance(module, Linear):
                    module.input_major()
        return self.eval()
