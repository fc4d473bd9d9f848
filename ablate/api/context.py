"""What plugins are built from: the model, the device and the shape of one token's K/V."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ablate.api.slots import KVCache
    from ablate.model.llama import LlamaModel


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8                 # sequences running at once (batch slots)
    max_num_batched_tokens: int = 4096    # tokens fed in one step (continuous batching limit)
    max_seq_len: int = 0                  # longest prompt + output; 0 -> taken from the workload

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"engine.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"engine.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_seq_len < 0:
            raise ValueError(f"engine.max_seq_len must be >= 0, got {self.max_seq_len}")


@dataclass(frozen=True)
class KVSpec:
    """The shape of what a KV cache stores per token and layer."""

    num_layers: int
    n_kv_heads: int
    k_head_dim: int           # MLA stores a latent + rotary key here and nothing in V
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_seq_len: int

    @property
    def bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype bytes, for K and V widths that may differ."""
        width = self.n_kv_heads * (self.k_head_dim + self.v_head_dim)
        return self.num_layers * width * self.dtype.itemsize

    @classmethod
    def of(cls, model: LlamaModel, engine: EngineConfig, max_seq_len: int) -> KVSpec:
        cfg = model.config
        heads, k_width, v_width = cfg.kv_cache_widths     # MLA: one latent row in K, nothing in V
        return cls(cfg.n_layers, heads, k_width, v_width, cfg.torch_dtype,
                   next(model.parameters()).device, engine.max_num_seqs, max_seq_len)


@dataclass
class BuildContext:
    model: LlamaModel
    kv_spec: KVSpec
    engine: EngineConfig
    kv_cache: KVCache | None = None   # set before the scheduler is built: it admits into the cache

    @property
    def device(self) -> torch.device:
        return self.kv_spec.device
