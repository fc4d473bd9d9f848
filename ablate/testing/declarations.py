"""The kit's checks of what a plugin declares: its config round-trips through Hydra, its requirements
are enforced, its stats and figures are well formed, and a plugin that is not exact says what it
may cost."""
from __future__ import annotations

import dataclasses

from ablate.api.plugin import Slot, Stat, StatFigure
from ablate.engine.arm import BASELINE, IncompatiblePlugins, check_compatible
from ablate.engine.registry import Registry, conf_dir
from ablate.testing.scenarios import ConformanceError

RESULT_COLUMNS = ("speedup",)    # results columns a plugin's figure may draw beside its own stats


def check_config_roundtrip(registry: Registry, slot: Slot, name: str) -> None:
    """Default config -> Hydra composition (`<slot>=<name>`) -> dataclass again: equal."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ablate.engine.config_store import register_configs

    cls = registry.get(slot, name)
    default = cls.config_class()
    if default.name != name:
        raise ConformanceError(f"{slot.value}={name}: {cls.config_class.__name__}().name is {default.name!r}")
    register_configs(registry)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        composed = compose(config_name="config", overrides=[f"{slot.value}={name}"])
    node = OmegaConf.to_container(composed[slot.value], resolve=True)
    rebuilt = registry.config(slot, name, node)
    if rebuilt != default:
        raise ConformanceError(f"{slot.value}={name}: config changed through Hydra: {rebuilt} != {default}")
    if registry.config(slot, name, dataclasses.asdict(rebuilt)) != default:
        raise ConformanceError(f"{slot.value}={name}: config does not round-trip through a dict")


def check_requirements_enforced(registry: Registry, slot: Slot, name: str) -> None:
    """Each declared requirement refuses a combination that breaks it, naming both plugins."""
    cls = registry.get(slot, name)
    for need in cls.requires:
        for other in [n for n in registry.choices(need.slot) if n not in need.names]:
            combo = {s: registry.get(s, n) for s, n in BASELINE.items()}
            combo[slot] = cls
            combo[need.slot] = registry.get(need.slot, other)
            try:
                check_compatible(combo)
            except IncompatiblePlugins as err:
                if name not in str(err) or other not in str(err):
                    raise ConformanceError(f"the refusal does not name both plugins: {err}") from err
            else:
                raise ConformanceError(f"{slot.value}={name} ran beside {need.slot.value}={other}, which its "
                                       f"requirement ({need.reason}) excludes")


def check_declarations(registry: Registry, slot: Slot, name: str) -> None:
    cls = registry.get(slot, name)
    plugin = f"{slot.value}={name}"
    stats = cls.reported_stats
    if not all(isinstance(s, Stat) for s in stats):
        raise ConformanceError(f"{plugin}: reported_stats must be a tuple of ablate.api.Stat")
    keys = [s.key for s in stats]
    if len(set(keys)) != len(keys):
        raise ConformanceError(f"{plugin}: a stat is declared twice in reported_stats: {keys}")
    for figure in cls.figures:
        if not isinstance(figure, StatFigure):
            raise ConformanceError(f"{plugin}: figures must be ablate.api.StatFigure, got {figure!r}")
        unknown = [k for k in (figure.x, *figure.series, *([figure.group_by] if figure.group_by else []))
                   if k not in keys and k not in RESULT_COLUMNS]
        if unknown:
            raise ConformanceError(f"{plugin}: figure {figure.name!r} draws {unknown}, which are neither its stats "
                                   f"({keys}) nor results columns ({', '.join(RESULT_COLUMNS)})")
    if not cls.exact and cls.quality is None:
        raise ConformanceError(
            f"{plugin} declares exact = False but no quality bound: set `quality = QualityBound(max_ratio=..., "
            f"num_tokens=..., config={{...}})` (ablate.api) on {cls.__name__}, the largest perplexity ratio to the "
            "baseline it may cost, so that the kit can check it")
