"""What every technique declares: its slot, name, config, needs, exactness and stats.

A plugin is a class; its entry point (group `ablate.plugins`) names the class. The core's
baselines are plugins too, found the same way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ablate.build import BuildContext


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


class Plugin:
    slot: ClassVar[Slot]
    name: ClassVar[str]
    config_class: ClassVar[type[PluginConfig]] = PluginConfig
    exact: ClassVar[bool] = True              # greedy tokens equal the baseline's, token for token
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
