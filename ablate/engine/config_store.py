"""The registry's plugins and the model presets in Hydra's ConfigStore, and the CLI's check of a
`slot.option=value` override before Hydra composes (Hydra's own message for an unknown option
suggests `+slot.option`, which would not work either)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ablate.api.plugin import Slot
from ablate.engine.registry import Registry, conf_dir


def register_configs(registry: Registry) -> None:
    """Store each plugin's config dataclass under its slot's group, and each model preset under
    `model`, in Hydra's ConfigStore: `kv_cache=contiguous`, `model=smollm2-135m` then work."""
    from hydra.core.config_store import ConfigStore

    from ablate.model.presets import PRESETS

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
