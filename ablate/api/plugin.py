"""What every technique declares: its slot, name, config, needs, exactness, quality bound and stats.

A plugin is a class; its entry point (group `ablate.plugins`) names the class. The core's
baselines are plugins too, found the same way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ablate.api.context import BuildContext


class Slot(str, enum.Enum):
    """The engine's five slots; the value is the Hydra config group that picks the plugin."""

    MODEL = "variant"          # model variants (GQA/MQA conversion, MLA) applied to the loaded model
    KV_CACHE = "kv_cache"
    ATTENTION = "attention"
    SCHEDULER = "scheduler"
    DECODING = "decoding"


@dataclass
class PluginConfig:
    """Base of every plugin's config dataclass: `name` picks the plugin within its slot."""

    name: str = ""


@dataclass(frozen=True)
class Requirement:
    """This plugin only works when `slot` holds one of `names`, because of `reason`."""

    slot: Slot
    names: frozenset[str]
    reason: str


QUALITY_METRICS = ("perplexity",)


@dataclass(frozen=True)
class QualityBound:
    """How much a plugin that is not exact may cost, and how the conformance kit measures it.

    The kit scores one seeded text of `num_tokens` tokens by teacher forcing through the baseline's
    engine and through the plugin's (options `config` on top of its defaults) and requires
    perplexity(plugin) / perplexity(baseline) <= max_ratio. `config` lets the check engage the
    technique on a short text (a small window, say), since the kit runs on a tiny model.
    """

    max_ratio: float                       # largest acceptable perplexity ratio to the baseline's (>= 1)
    num_tokens: int = 128                  # length of the scored text: long enough that the technique acts
    config: dict[str, Any] = field(default_factory=dict)   # the plugin's options for the check
    metric: str = "perplexity"             # the only metric the kit measures so far

    def __post_init__(self) -> None:
        if self.metric not in QUALITY_METRICS:
            raise ValueError(f"QualityBound.metric must be one of {QUALITY_METRICS}, got {self.metric!r}")
        if not self.max_ratio >= 1:
            raise ValueError(f"QualityBound.max_ratio must be >= 1 (the baseline's own ratio), got {self.max_ratio}")
        if self.num_tokens < 2:
            raise ValueError(f"QualityBound.num_tokens must be >= 2 (one token predicts the next), got {self.num_tokens}")


class Plugin:
    slot: ClassVar[Slot]
    name: ClassVar[str]
    config_class: ClassVar[type[PluginConfig]] = PluginConfig
    exact: ClassVar[bool] = True              # greedy tokens equal the baseline's, token for token
    quality: ClassVar[QualityBound | None] = None   # not exact: what it may cost (the kit checks it)
    requires: ClassVar[tuple[Requirement, ...]] = ()
    stats_keys: ClassVar[tuple[str, ...]] = ()  # keys `stats()` always returns

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        self.config = config

    def stats(self) -> dict[str, float | str]:
        """Technique-specific figures for the results (stable keys: `stats_keys`)."""
        return {}

    def close(self) -> None:
        """Free what the plugin holds (tensors, threads) when its arm is done."""


class IncompatiblePlugins(ValueError):
    """Two plugins chosen for one arm cannot run together."""


def check_compatible(plugins: dict[Slot, type[Plugin]]) -> None:
    """Refuse a combination before any model loads, naming both plugins and the reason."""
    for plugin in plugins.values():
        for need in plugin.requires:
            other = plugins.get(need.slot)
            if other is None or other.name not in need.names:
                got = other.name if other else "nothing"
                raise IncompatiblePlugins(
                    f"{plugin.slot.value}={plugin.name} cannot run with {need.slot.value}={got}: "
                    f"it needs {need.slot.value} in {sorted(need.names)} ({need.reason})"
                )
