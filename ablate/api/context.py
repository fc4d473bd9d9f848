"""What plugins are built from: the model, the engine's limits, the shape of one token's K/V, and
the plugins built before them."""
from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ablate.api.kv import KVSpec

# engine.moe_experts: how a mixture-of-experts layer computes its routed experts (ablate/model/moe.py):
# loop = a pair of products per expert reached (counts read on the host); grouped = one grouped
# product per projection over the token slots sorted by expert (no host sync)
MOE_EXPERTS = ("loop", "grouped")

if TYPE_CHECKING:
    from ablate.api.executor import ModelSession
    from ablate.api.kv_cache import KVCache
    from ablate.api.slots import Attention


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8                 # sequences running at once (batch slots)
    max_num_batched_tokens: int = 4096    # tokens fed in one step (continuous batching limit)
    max_seq_len: int = 0                  # longest prompt + output; 0 -> taken from the workload
    # capture decode steps and replay them: CUDA graphs on a GPU, torch.compile on a CPU
    # (ablate/engine/graphs.py); arms whose plugins are not graph_safe run eagerly, saying why
    graphs: bool = False
    moe_experts: str = "loop"             # MOE_EXPERTS; a dense model has no experts and ignores it

    def __post_init__(self) -> None:
        if not isinstance(self.graphs, bool):
            raise ValueError(f"engine.graphs must be true or false, got {self.graphs!r}")
        if self.moe_experts not in MOE_EXPERTS:
            raise ValueError(f"engine.moe_experts must be one of {', '.join(MOE_EXPERTS)}, got {self.moe_experts!r}")
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_seq_len", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"engine.{name} must be a whole number >= {low}, got {value!r}")
            if value < low:
                raise ValueError(f"engine.{name} must be >= {low}, got {value}")


class NotBuiltYet(AttributeError):
    pass


@dataclass
class BuildContext:
    """Handed to every plugin's constructor. The engine builds an arm's plugins in this order:

        variant -> kv_cache -> attention -> decoding -> scheduler

    (the variant first, since it may change the model the others are built for), so a plugin may
    use what was built before it: the scheduler admits into `kv_cache` and reserves
    `num_lookahead_tokens` for decoding; a decoding plugin that drafts with a model asks for
    `model_session(model)`, which runs that model through a fresh cache of the arm's kv_cache
    plugin and the arm's attention.
    """

    model: Any                      # the LlamaModel the arm runs (after its variant)
    kv_spec: KVSpec
    engine: EngineConfig
    _kv_cache: KVCache | None = None
    _attention: Attention | None = None
    num_lookahead_tokens: int = 0   # set from the decoding plugin before the scheduler is built
    _model_session: Callable[[Any], ModelSession] | None = None

    @property
    def device(self) -> torch.device:
        return self.kv_spec.device

    @property
    def kv_cache(self) -> KVCache:
        if self._kv_cache is None:
            raise NotBuiltYet("ctx.kv_cache is built after the variant: a variant plugin cannot use it")
        return self._kv_cache

    @property
    def attention(self) -> Attention:
        if self._attention is None:
            raise NotBuiltYet("ctx.attention is built after the variant and the kv_cache")
        return self._attention

    def model_session(self, model: Any) -> ModelSession:
        """Run `model` (a draft, or a subset of the target's layers) over the engine's sequences with a
        KV cache of its own: the arm's kv_cache plugin and options, and the arm's attention."""
        if self._model_session is None:
            raise NotBuiltYet("ctx.model_session is available to decoding plugins (built after kv_cache and attention)")
        return self._model_session(model)
