"""ablate's plugin contract: everything a plugin imports, in one place.

    from ablate.api import KVCache, KVSpec, PaddedKV, PluginConfig, Sequence, StepInputs, ...

A plugin subclasses one slot's base class (KVCache, Attention, Scheduler, Decoding, ModelVariant),
declares a config dataclass deriving from PluginConfig, and is found through the entry-point group
`ablate.plugins` (`<slot>.<name> = "package.module:Class"`). The rules of each slot, who calls
what and in which order, are in ablate/api/slots.py; docs/writing-a-plugin.md walks through
one. Variants and drafters that build models also import from ablate.api.model.
"""
from ablate.api.clock import now
from ablate.api.context import BuildContext, EngineConfig
from ablate.api.executor import Executor, ModelSession
from ablate.api.kv import (KVBudgetConfig, KVSpec, KVView, PackedKV, PaddedKV, PagedKV, PagedPlaces,
                           budget_bytes, free_memory_bytes)
from ablate.api.kv_cache import KVCache
from ablate.api.packing import LayerAttention, causal_mask, pad_queries, softcapped_attention, unpad_queries
from ablate.api.plugin import Plugin, PluginConfig, PluginError, QualityBound, Requirement, Slot, Stat, StatFigure
from ablate.api.rows import RowBuffers
from ablate.api.sampling import Sampler, greedy, probabilities
from ablate.api.sequence import Request, SamplingParams, Sequence, Status
from ablate.api.slots import Attention, Decoding, ModelVariant, Scheduler
from ablate.api.step import Batch, StepInputs, StepLogits, device_tensor

__all__ = [
    "Attention", "Batch", "BuildContext", "Decoding", "EngineConfig", "Executor", "KVBudgetConfig", "KVCache",
    "KVSpec", "KVView", "LayerAttention", "ModelSession", "ModelVariant", "PackedKV", "PaddedKV", "PagedKV",
    "PagedPlaces", "Plugin", "PluginConfig", "PluginError", "QualityBound", "Request", "Requirement", "RowBuffers",
    "Sampler", "SamplingParams", "Scheduler", "Sequence", "Slot", "Stat", "StatFigure", "Status", "StepInputs",
    "StepLogits", "budget_bytes", "causal_mask", "device_tensor", "free_memory_bytes", "greedy", "now", "pad_queries",
    "probabilities", "softcapped_attention", "unpad_queries",
]
