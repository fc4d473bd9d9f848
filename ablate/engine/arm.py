"""An arm: one choice of plugin per slot. Building it gives an engine over a shared model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ablate.api.context import BuildContext, EngineConfig, KVSpec
from ablate.engine.engine import Engine
from ablate.api.slots import Attention, Decoding, KVCache, ModelVariant, Scheduler
from ablate.model.llama import LlamaModel
from ablate.api.plugin import Plugin, PluginConfig, Slot, check_compatible
from ablate.engine.registry import Registry
from ablate.engine.runner import ModelRunner

BASELINE = {Slot.MODEL: "none", Slot.KV_CACHE: "none", Slot.ATTENTION: "naive",
            Slot.SCHEDULER: "static", Slot.DECODING: "autoregressive"}


@dataclass
class Arm:
    name: str
    plugins: dict[Slot, PluginConfig]
    model_overrides: dict[str, Any] = field(default_factory=dict)   # e.g. {"n_kv_heads": 1}

    def label(self) -> str:
        """`kv_cache=contiguous attention=naive ...`: the plugins that differ from the baseline."""
        parts = [f"{s.value}={c.name}" for s, c in self.plugins.items() if c.name != BASELINE[s]]
        return " ".join(parts) or "baseline"


def resolve_arm(name: str, spec: dict[str, Any], base: dict[Slot, PluginConfig], registry: Registry) -> Arm:
    """Apply an arm's spec ({slot: plugin name | {name: ..., option: value}, model: {...}}) to `base`.

    A slot the spec does not mention keeps the base's plugin; a slot naming the base's plugin
    keeps the base's options too, with the spec's options on top.
    """
    spec = dict(spec or {})
    model_overrides = dict(spec.pop("model", None) or {})
    valid = {s.value for s in Slot}
    unknown = sorted(set(spec) - valid)
    if unknown:
        raise ValueError(f"arm {name!r}: unknown slot {', '.join(unknown)}; slots are {', '.join(sorted(valid))} "
                         "(and `model` for model fields)")
    plugins = dict(base)
    for slot_name, choice in spec.items():
        slot = Slot(slot_name)
        fields = dict(choice) if isinstance(choice, dict) else {"name": choice}
        if "name" not in fields:
            raise ValueError(f"arm {name!r}: {slot_name} needs a plugin `name` (one of {registry.choices(slot)})")
        plugin_name = fields["name"]
        if base[slot].name == plugin_name:
            fields = {**_fields(base[slot]), **fields}
        plugins[slot] = registry.config(slot, plugin_name, fields)
    arm = Arm(name, plugins, model_overrides)
    check_compatible({s: registry.get(s, c.name) for s, c in arm.plugins.items()})
    return arm


def _fields(config: PluginConfig) -> dict[str, Any]:
    return asdict(config)


def baseline_configs(registry: Registry) -> dict[Slot, PluginConfig]:
    return {slot: registry.config(slot, name) for slot, name in BASELINE.items()}


@dataclass
class BuiltArm:
    engine: Engine
    plugins: dict[Slot, Plugin]

    @property
    def kv_cache(self) -> KVCache:
        return self.plugins[Slot.KV_CACHE]

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for plugin in self.plugins.values():
            out |= {f"{plugin.slot.value}.{k}": v for k, v in plugin.stats().items()}
        return out

    def close(self) -> None:
        for plugin in self.plugins.values():
            plugin.close()


def build_arm(arm: Arm, model: LlamaModel, engine: EngineConfig, max_seq_len: int, registry: Registry,
              hooks_for=lambda kv_cache: ()) -> BuiltArm:
    """Instantiate the arm's plugins around `model` (weights shared between arms)."""
    def make(slot: Slot, ctx: BuildContext) -> Plugin:
        return registry.get(slot, arm.plugins[slot].name)(arm.plugins[slot], ctx)

    ctx = BuildContext(model, KVSpec.of(model, engine, max_seq_len), engine)
    variant: ModelVariant = make(Slot.MODEL, ctx)
    model = variant.apply(model)
    ctx = BuildContext(model, KVSpec.of(model, engine, max_seq_len), engine)
    kv_cache: KVCache = make(Slot.KV_CACHE, ctx)
    ctx.kv_cache = kv_cache
    attention: Attention = make(Slot.ATTENTION, ctx)
    scheduler: Scheduler = make(Slot.SCHEDULER, ctx)
    decoding: Decoding = make(Slot.DECODING, ctx)
    engine_ = Engine(ModelRunner(model, kv_cache, attention), scheduler, decoding, hooks_for(kv_cache))
    plugins = {Slot.MODEL: variant, Slot.KV_CACHE: kv_cache, Slot.ATTENTION: attention,
               Slot.SCHEDULER: scheduler, Slot.DECODING: decoding}
    return BuiltArm(engine_, plugins)
