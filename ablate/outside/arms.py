"""An arm of any engine: ablate's own, whose plugins ablate.engine.arm resolves, or an outside
engine's (`{engine: {name: hf, ...}}`), its class found through the `ablate.engines` entry points
(ablate.outside.discovery) and its options built into its config_class. An experiment resolves its arms here: the
engine package knows nothing of outside engines."""
from __future__ import annotations

from typing import Any

from ablate.api.plugin import PluginConfig, Slot
from ablate.engine import arm as own
from ablate.engine.arm import ENGINE_KEY, Arm, ArmSpec
from ablate.engine.registry import Registry
from ablate.outside.discovery import load_engine


def resolve_arm(name: str, spec: ArmSpec | dict[str, Any] | None, base: dict[Slot, PluginConfig],
                registry: Registry) -> Arm:
    """ablate.engine.arm.resolve_arm for an arm of ablate's own engine; for an outside engine's, its
    class and its config, built from the spec's options (its plugins, unused, are the base's)."""
    if not isinstance(spec, ArmSpec):
        spec = ArmSpec.parse(f"arm {name!r}", spec)
    if spec.outside is None:
        return own.resolve_arm(name, spec, base, registry)
    options = {k: v for k, v in spec.outside.items() if k != "name"}
    cls = load_engine(f"arm {name!r}", spec.outside["name"])
    return Arm(name, dict(base), outside=(cls, cls.resolve_options(f"arm {name!r}.{ENGINE_KEY}", options)))
