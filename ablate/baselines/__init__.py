"""The core's baseline for each slot: what every technique is measured against. They are plugins
like any other (found through entry points, built on ablate.api only)."""
from ablate.baselines.autoregressive import Autoregressive
from ablate.baselines.naive_attention import NaiveAttention
from ablate.baselines.no_cache import NoKVCache
from ablate.baselines.static_scheduler import StaticScheduler
from ablate.baselines.unchanged_model import UnchangedModel

__all__ = ["Autoregressive", "NaiveAttention", "NoKVCache", "StaticScheduler", "UnchangedModel"]
