"""An arm: one choice of plugin per slot. Building it gives an engine over a shared model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ablate.api.context import BuildContext, EngineConfig
from ablate.api.kv import KVSpec
from ablate.api.kv_cache import KVCache
from ablate.api.plugin import Plugin, PluginConfig, PluginError, Slot, blame
from ablate.api.slots import Attention, Decoding, ModelVariant, Scheduler
from ablate.engine.engine import Engine
from ablate.engine.registry import Registry
from ablate.engine.runner import ModelRunner
from ablate.engine.session import ModelRunSession
from ablate.model.llama import LlamaModel

BASELINE = {Slot.MODEL: "none", Slot.KV_CACHE: "none", Slot.ATTENTION: "naive",
            Slot.SCHEDULER: "static", Slot.DECODING: "autoregressive"}
MODEL_KEY = "model"     # an arm spec key that sets model fields rather than a slot's plugin
ENGINE_KEY = "engine"   # an arm spec key that sets engine options per arm
ARM_ENGINE_OPTIONS = ("graphs", "moe_experts")   # the engine options an arm may set (the limits are the experiment's)
OWN_ENGINE = "ablate"        # engine.name of an arm that runs ablate's own engine (any other: ablate.outside)


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


def check_attention_features(attention: type[Attention], model: LlamaModel) -> None:
    """Refuse an attention plugin that lacks a feature the model's layers need (a sliding window,
    soft-capped scores), naming the plugin, the feature and the layers, before anything is built."""
    cfg = model.config
    layers = [cfg.layer_attention(i) for i in range(cfg.n_layers)] if hasattr(cfg, "layer_attention") else []
    why = attention.missing_features(layers)
    if why is not None:
        raise IncompatiblePlugins(f"model {cfg.name!r}: {why}")


@dataclass(frozen=True)
class ArmSpec:
    """What an arm sets over the composed config: per slot a plugin and options, and model fields."""

    plugins: dict[Slot, dict[str, Any]] = field(default_factory=dict)   # slot -> {name: ..., option: value}
    model: dict[str, Any] = field(default_factory=dict)                 # e.g. {"n_kv_heads": 1}
    engine: dict[str, Any] = field(default_factory=dict)                # e.g. {"graphs": True}
    outside: dict[str, Any] | None = None                               # e.g. {"name": "hf", "cache": "static"}

    @classmethod
    def parse(cls, where: str, raw: dict[str, Any] | None) -> ArmSpec:
        """{slot: plugin | {name: plugin, option: value}, model: {field: value}, engine: {option: value}}
        -> ArmSpec; or an outside engine's arm: {engine: name | {name: name, option: value}}."""
        raw = dict(raw or {})
        model = raw.pop(MODEL_KEY, None) or {}
        if not isinstance(model, dict):
            raise ValueError(f"{where}.{MODEL_KEY} must map model fields to values, got {model!r}")
        engine = raw.pop(ENGINE_KEY, None) or {}
        if isinstance(engine, str) and engine not in ARM_ENGINE_OPTIONS:    # `engine: hf` names an outside engine
            engine = {"name": engine}
        if isinstance(engine, dict) and engine.get("name", OWN_ENGINE) != OWN_ENGINE:
            if raw or model:
                raise ValueError(f"{where} runs engine={engine['name']}, which sets no ablate slot or model field "
                                 f"(got {', '.join(sorted([*raw, *([MODEL_KEY] if model else [])]))}): an outside "
                                 "engine runs the experiment's model its own way")
            return cls(outside=dict(engine))
        engine = {k: v for k, v in engine.items() if k != "name"} if isinstance(engine, dict) else engine
        options = set(ARM_ENGINE_OPTIONS)
        if not isinstance(engine, dict) or set(engine) - options:
            raise ValueError(f"{where}.{ENGINE_KEY} must map engine options ({', '.join(sorted(options))}) to "
                             f"values, or name an outside engine ({ENGINE_KEY}: {{name: hf}}), got {engine!r}")
        valid = {s.value for s in Slot}
        unknown = sorted(set(raw) - valid)
        if unknown:
            raise ValueError(f"{where}: unknown slot {', '.join(unknown)}; slots are {', '.join(sorted(valid))} "
                             f"(and `{MODEL_KEY}` for model fields, `{ENGINE_KEY}` for engine options)")
        plugins = {}
        for slot_name, choice in raw.items():
            fields = dict(choice) if isinstance(choice, dict) else {"name": choice}
            if not isinstance(fields.get("name"), str) or not fields["name"]:
                raise ValueError(f"{where}.{slot_name} needs a plugin `name`, got {choice!r}")
            plugins[Slot(slot_name)] = fields
        return cls(plugins, dict(model), dict(engine))


@dataclass
class Arm:
    name: str
    plugins: dict[Slot, PluginConfig]
    model_overrides: dict[str, Any] = field(default_factory=dict)   # e.g. {"n_kv_heads": 1}
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {"graphs": True}
    # an outside engine's arm, resolved by ablate.outside.arms: its class (an ablate.outside.contract
    # OutsideEngine) and its config (of the class's config_class, a dataclass); its plugins are unused
    outside: tuple[type, Any] | None = None

    def label(self) -> str:
        """`kv_cache=contiguous attention=naive ...`: the plugins and engine options that differ from
        the baseline; `engine=hf cache=static` for an outside engine (its options that differ from their defaults)."""
        if self.outside is not None:
            cls, config = self.outside
            defaults = asdict(type(config)(name=config.name))
            return " ".join([f"engine={cls.name}"] + [f"{k}={v}" for k, v in asdict(config).items() if v != defaults[k]])
        parts = [f"{s.value}={c.name}" for s, c in self.plugins.items() if c.name != BASELINE[s]]
        parts += [f"engine.{k}={v}" for k, v in sorted(self.engine_overrides.items())]
        return " ".join(parts) or "baseline"


def resolve_arm(name: str, spec: ArmSpec | dict[str, Any] | None, base: dict[Slot, PluginConfig],
                registry: Registry) -> Arm:
    """Apply an arm's spec to `base`: a slot the spec does not mention keeps the base's plugin; a
    slot naming the base's plugin keeps the base's options too, with the spec's on top. An arm of
    ablate's own engine only: ablate.outside.arms.resolve_arm resolves an outside engine's too."""
    if not isinstance(spec, ArmSpec):
        spec = ArmSpec.parse(f"arm {name!r}", spec)
    if spec.outside is not None:
        raise ValueError(f"arm {name!r} runs engine={spec.outside['name']}, an outside engine: "
                         "ablate.outside.arms.resolve_arm resolves its arm, not ablate.engine.arm")
    plugins = dict(base)
    for slot, fields in spec.plugins.items():
        if base[slot].name == fields["name"]:
            fields = {**asdict(base[slot]), **fields}
        plugins[slot] = registry.config(slot, fields["name"], fields)
    arm = Arm(name, plugins, dict(spec.model), dict(spec.engine))
    check_compatible({s: registry.get(s, c.name) for s, c in arm.plugins.items()})
    return arm


def baseline_configs(registry: Registry) -> dict[Slot, PluginConfig]:
    return {slot: registry.config(slot, name) for slot, name in BASELINE.items()}


@dataclass
class BuiltArm:
    engine: Engine
    plugins: dict[Slot, Plugin]

    @property
    def kv_cache(self) -> KVCache:
        return self.plugins[Slot.KV_CACHE]

    def stats(self) -> dict[str, float | str]:
        """Every plugin's stats as `slot.key` columns, checked against what each declares."""
        out: dict[str, float | str] = {}
        for plugin in self.plugins.values():
            with blame(plugin, "stats"):
                values = plugin.stats()
            declared = {s.key for s in type(plugin).reported_stats}
            if set(values) != declared:
                missing, extra = sorted(declared - set(values)), sorted(set(values) - declared)
                raise PluginError(plugin, "stats", f"returned keys that differ from its reported_stats: "
                                  f"missing {missing}, undeclared {extra}")
            out |= {f"{plugin.slot.value}.{k}": v for k, v in values.items()}
        runner = self.engine.runner
        return out | {f"engine.{k}": v for k, v in (runner.graph_stats() | runner.layer_stats()
                                                          | runner.experts_stats()).items()}

    def close(self) -> None:
        if self.engine.runner.graphs is not None:
            self.engine.runner.graphs.close()
        for plugin in self.plugins.values():
            plugin.close()


def build_arm(arm: Arm, model: LlamaModel, engine: EngineConfig, max_seq_len: int, registry: Registry,
              hooks_for=lambda kv_cache: ()) -> BuiltArm:
    """Instantiate the arm's plugins around `model` (weights shared between arms), in the order
    BuildContext documents: variant, kv_cache, attention, decoding, scheduler."""
    if max_seq_len > model.config.max_seq_len:     # positions past it have no RoPE rows
        raise ValueError(f"sequences of up to {max_seq_len} tokens cannot run on model {model.config.name!r}, built "
                         f"for {model.config.max_seq_len} (model.max_seq_len): raise model.max_seq_len (up to "
                         "the checkpoint's context length) or shorten the workload")
    engine = replace(engine, **arm.engine_overrides)
    def make(slot: Slot, ctx: BuildContext) -> Plugin:
        config = arm.plugins[slot]
        with blame(f"{slot.value}={config.name}", "__init__"):
            return registry.get(slot, config.name)(config, ctx)

    variant: ModelVariant = make(Slot.MODEL, BuildContext(model, KVSpec.of(model, engine, max_seq_len), engine))
    with blame(variant, "apply"):
        model = variant.apply(model)
    attention_class = registry.get(Slot.ATTENTION, arm.plugins[Slot.ATTENTION].name)
    check_attention_features(attention_class, model)
    spec = KVSpec.of(model, engine, max_seq_len)
    if not attention_class.reads_key_rings:      # its mask would take a ring's rows for positions
        spec = replace(spec, windows=())
    ctx = BuildContext(model, spec, engine)
    kv_cache: KVCache = make(Slot.KV_CACHE, ctx)
    ctx._kv_cache = kv_cache
    attention: Attention = make(Slot.ATTENTION, ctx)
    ctx._attention = attention

    def model_session(draft: LlamaModel) -> ModelRunSession:
        # a session feeds a whole prompt in one step, and rolls back past where its last step began:
        # its cache keeps every position of a windowed layer (max_step_tokens = max_seq_len: no ring)
        draft_ctx = BuildContext(draft, KVSpec.of(draft, engine, max_seq_len, max_step_tokens=max_seq_len), engine)
        return ModelRunSession(draft, make(Slot.KV_CACHE, draft_ctx), attention)

    ctx._model_session = model_session
    decoding: Decoding = make(Slot.DECODING, ctx)
    ctx.num_lookahead_tokens = decoding.num_lookahead_tokens
    scheduler: Scheduler = make(Slot.SCHEDULER, ctx)
    runner = ModelRunner(model, kv_cache, attention, decoding_name=str(decoding), graphs=engine.graphs,
                         moe_experts=engine.moe_experts)
    plugins = {Slot.MODEL: variant, Slot.KV_CACHE: kv_cache, Slot.ATTENTION: attention,
               Slot.SCHEDULER: scheduler, Slot.DECODING: decoding}
    return BuiltArm(Engine(runner, scheduler, decoding, engine, hooks_for(kv_cache)), plugins)
