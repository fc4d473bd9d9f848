"""kv_cache=none: keep nothing, so every step recomputes each sequence's whole prefix."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api import KVCache, PackedKV, PluginConfig, Sequence, StepInputs


@dataclass
class NoKVCacheConfig(PluginConfig):
    name: str = "none"


class NoKVCache(KVCache):
    name = "none"
    config_class = NoKVCacheConfig
    keeps_kv = False   # the runner feeds tokens[0 : n] every step instead of the new ones only

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return True

    def free(self, seq: Sequence) -> None:
        pass

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        self._step_kv = PackedKV(k, v)   # lives for this layer's attention only

    def view(self, layer: int, step: StepInputs) -> PackedKV:
        return self._step_kv

    def bytes_reserved(self) -> int:
        return 0

    def bytes_used(self) -> int:
        return 0
