"""Plugin discovery through entry points (group `ablate.plugins`), and their Hydra configs.

Built-in and third-party plugins are found the same way. Like pluggy: a duplicate is skipped, a
plugin that fails to load is a warning naming it and its error (never a crash of the rest), a
plugin can be blocked by name, and `python -m ablate plugins` lists what was found.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from ablate.api.plugin import Plugin, PluginConfig, Slot

GROUP = "ablate.plugins"
BLOCK_ENV = "ABLATE_BLOCK_PLUGINS"    # comma-separated `slot.name` or entry-point names to skip


@dataclass
class PluginInfo:
    entry_point: str       # the entry point's name
    target: str            # module:Class it names
    source: str            # the distribution (package) that declares it
    status: str            # loaded | blocked | duplicate | error: ...
    slot: str = "?"
    name: str = "?"
    cls: type[Plugin] | None = None


class UnknownPlugin(ValueError):
    pass


class Registry:
    def __init__(self, infos: list[PluginInfo]) -> None:
        self.infos = infos
        self.plugins: dict[tuple[Slot, str], type[Plugin]] = {
            (i.cls.slot, i.cls.name): i.cls for i in infos if i.status == "loaded" and i.cls is not None
        }

    def with_plugins(self, *classes: type[Plugin]) -> Registry:
        """This registry plus plugin classes not installed as packages: a plugin under test (the
        conformance kit runs on it before it is packaged)."""
        infos = []
        for cls in classes:
            problem = _check_plugin_class(cls)
            if problem:
                raise ValueError(f"{cls!r} is not a valid plugin: {problem}")
            infos.append(PluginInfo(f"{cls.slot.value}.{cls.name}", f"{cls.__module__}:{cls.__qualname__}",
                                    "(not installed)", "loaded", cls.slot.value, cls.name, cls))
        return Registry([*self.infos, *infos])

    def choices(self, slot: Slot) -> list[str]:
        return sorted(name for s, name in self.plugins if s is slot)

    def get(self, slot: Slot, name: str) -> type[Plugin]:
        if (slot, name) not in self.plugins:
            raise UnknownPlugin(
                f"unknown {slot.value} plugin {name!r}; valid choices: {', '.join(self.choices(slot)) or 'none'}"
                + self._why_missing(slot, name)
            )
        return self.plugins[(slot, name)]

    def _why_missing(self, slot: Slot, name: str) -> str:
        for info in self.infos:
            if info.status != "loaded" and name in (info.name, info.entry_point.split(".")[-1]) \
                    and info.slot in (slot.value, "?"):
                why = f" ({info.entry_point} from {info.source} is {info.status})"
                if info.status == "blocked" and {info.entry_point, f"{info.slot}.{info.name}"} & set(_env_blocked()):
                    why += f": the environment variable {BLOCK_ENV}={os.environ[BLOCK_ENV]} blocks it; remove it there to use it"
                return why
        return ""

    def config(self, slot: Slot, name: str, fields: dict | None = None) -> PluginConfig:
        """The plugin's config dataclass built (and validated) from plain fields."""
        cls = self.get(slot, name)
        fields = {k: v for k, v in (fields or {}).items() if k != "name"}
        known = {f.name for f in dataclasses.fields(cls.config_class)} - {"name"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"{slot.value}={name} has no option {', '.join(unknown)}; its options are: {', '.join(sorted(known)) or 'none'}"
            )
        return cls.config_class(name=name, **fields)

    def table(self) -> list[dict[str, str]]:
        return [{"slot": i.slot, "name": i.name, "source": i.source, "status": i.status, "target": i.target}
                for i in sorted(self.infos, key=lambda i: (i.slot, i.name))]


def _load(ep: EntryPoint) -> PluginInfo:
    source = ep.dist.name if ep.dist is not None else "?"
    info = PluginInfo(ep.name, ep.value, source, "loaded", *_declared(ep.name))
    try:
        cls = ep.load()
    except Exception as err:   # a broken plugin must not break the others
        info.status = f"error: {type(err).__name__}: {err}"
        return info
    problem = _check_plugin_class(cls)
    if problem:
        info.status = f"error: {problem}"
        return info
    info.slot, info.name, info.cls = cls.slot.value, cls.name, cls
    return info


def _declared(entry_point: str) -> tuple[str, str]:
    """The slot and name an entry point `slot.name` declares: what the listing shows for a plugin
    that is blocked or failed to load (one that loads shows its class's own slot and name)."""
    slot, dot, name = entry_point.partition(".")
    return (slot, name) if dot else ("?", entry_point)


def _check_plugin_class(cls: object) -> str | None:
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        return f"{cls!r} is not a subclass of ablate.api.plugin.Plugin"
    for attr in ("slot", "name"):
        if not hasattr(cls, attr):
            return f"{cls.__name__} does not declare `{attr}`"
    if not isinstance(cls.slot, Slot):
        return f"{cls.__name__}.slot must be an ablate.api.plugin.Slot, got {cls.slot!r}"
    if not (dataclasses.is_dataclass(cls.config_class) and issubclass(cls.config_class, PluginConfig)):
        return f"{cls.__name__}.config_class must be a dataclass deriving from PluginConfig"
    default_name = {f.name: f.default for f in dataclasses.fields(cls.config_class)}.get("name")
    if default_name != cls.name:
        return f"{cls.config_class.__name__}.name defaults to {default_name!r}, expected {cls.name!r}"
    return None


def _env_blocked() -> tuple[str, ...]:
    return tuple(b.strip() for b in os.environ.get(BLOCK_ENV, "").split(",") if b.strip())


def discover(blocked: tuple[str, ...] = ()) -> Registry:
    """Load every plugin of the entry-point group; warn about (never raise for) broken ones."""
    blocked = tuple(blocked) + _env_blocked()
    infos: list[PluginInfo] = []
    seen: dict[tuple[str, str], PluginInfo] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        if ep.name in blocked:
            infos.append(PluginInfo(ep.name, ep.value, ep.dist.name if ep.dist else "?", "blocked", *_declared(ep.name)))
            continue
        info = _load(ep)
        key = (info.slot, info.name)
        if info.status == "loaded" and f"{info.slot}.{info.name}" in blocked:
            info.status = "blocked"
        elif info.status == "loaded" and key in seen:
            if seen[key].target == info.target:
                continue   # the same plugin seen twice (e.g. an editable install and a regular one)
            info.status = f"duplicate of {seen[key].target} from {seen[key].source}"
            warnings.warn(f"ablate: plugin {info.slot}={info.name} ({info.target}) is a duplicate; skipped",
                          stacklevel=2)
        elif info.status.startswith("error"):
            warnings.warn(f"ablate: plugin {ep.name!r} ({ep.value}, from {info.source}) could not be loaded "
                          f"and is skipped: {info.status.removeprefix('error: ')}", stacklevel=2)
        if info.status == "loaded":
            seen[key] = info
        infos.append(info)
    names = {i.entry_point for i in infos} | {f"{i.slot}.{i.name}" for i in infos}
    unknown = [b for b in _env_blocked() if b not in names]
    if unknown:    # a typo would otherwise block nothing, silently
        raise ValueError(f"{BLOCK_ENV}={os.environ[BLOCK_ENV]}: {', '.join(unknown)} names no plugin; entries are "
                         f"slot.name, e.g. kv_cache.paged (python -m ablate plugins lists them)")
    return Registry(infos)


def conf_dir() -> Path:
    """The Hydra config shipped with the package (ablate/conf: the repository's conf/)."""
    return Path(__file__).resolve().parents[1] / "conf"


@cache
def default_registry() -> Registry:
    return discover()


def register_configs(registry: Registry) -> None:
    """Store each plugin's config dataclass under its slot's group, and each model preset under
    `model`, in Hydra's ConfigStore: `kv_cache=contiguous`, `model=smollm2-135m` then work."""
    from hydra.core.config_store import ConfigStore

    from ablate.model.config import PRESETS

    cs = ConfigStore.instance()
    for (slot, name), cls in registry.plugins.items():
        cs.store(group=slot.value, name=name, node=cls.config_class)
    # a blocked or broken plugin gets a bare node, so that `kv_cache=paged` composes and the config's
    # validation says why it is missing (Registry.get), instead of Hydra's "Could not find 'kv_cache/paged'"
    slots = {s.value: s for s in Slot}
    for info in registry.infos:
        if info.status != "loaded" and info.slot in slots and (slots[info.slot], info.name) not in registry.plugins:
            cs.store(group=info.slot, name=info.name, node={"name": info.name})
    for name, cfg in PRESETS.items():
        cs.store(group="model", name=name, node=cfg)


def _chosen_plugins(path: Path) -> dict[str, str]:
    """slot -> plugin a config file picks: in its defaults list (`- kv_cache: none`, `- override
    /kv_cache: paged`) or in its body (`kv_cache: {name: paged}`)."""
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(OmegaConf.load(path))
        defaults = config.get("defaults") or []
    except (OSError, ValueError, AttributeError):
        return {}
    chosen = {}
    for entry in defaults:
        if isinstance(entry, dict):
            for key, value in entry.items():
                chosen[str(key).removeprefix("override ").strip().lstrip("/")] = str(value)
    for slot in Slot:      # a file that sets `kv_cache: {name: paged, ...}` itself
        node = config.get(slot.value)
        if isinstance(node, dict) and node.get("name"):
            chosen[slot.value] = str(node["name"])
    return chosen


def unknown_option(registry: Registry, overrides: list[str]) -> str | None:
    """For the CLI, before Hydra composes: the message for an override `slot.option=value` whose
    option the slot's plugin does not have, listing the options it has (Hydra's own message says
    "Could not override ... use +kv_cache.option", which would not work either). The plugin is the
    overrides' `slot=name`, else the +experiment file's, else conf/config.yaml's. None when all is well."""
    slots = {s.value: s for s in Slot}
    chosen = _chosen_plugins(conf_dir() / "config.yaml")
    pairs = [(key.lstrip("+~"), value) for key, _, value in (o.partition("=") for o in overrides)]
    for key, value in pairs:
        if key == "experiment" and value and "," not in value:
            chosen |= _chosen_plugins(conf_dir() / "experiment" / f"{value}.yaml")
    chosen |= {key: value for key, value in pairs if key in slots}
    for key, _ in pairs:
        slot, dot, option = key.partition(".")
        if not dot or slot not in slots or "." in option or slot not in chosen:
            continue
        for name in chosen[slot].split(","):          # a sweep over plugins: each must have the option
            cls = registry.plugins.get((slots[slot], name.strip()))
            known = {f.name for f in dataclasses.fields(cls.config_class)} - {"name"} if cls else {option}
            if option not in known:
                return (f"{slot}={name.strip()} has no option {option}; its options are: "
                        f"{', '.join(sorted(known)) or 'none'}")
    return None
