"""Outside engines are found through the entry points of group `ablate.engines`, as plugins are
through `ablate.plugins`: `hf = "ablate.engines.hf:HFGenerate"` in a package's pyproject.toml."""
from __future__ import annotations

from importlib.metadata import entry_points

from ablate.engines.contract import OutsideEngine

GROUP = "ablate.engines"
OWN_ENGINE = "ablate"        # engine.name of an arm that runs ablate's own engine


def engine_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_engine(where: str, name: str) -> type[OutsideEngine]:
    """The class of outside engine `name`; a ValueError naming the known ones when there is none, or
    naming the entry point when it does not give an OutsideEngine."""
    points = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in points:
        raise ValueError(f"{where}: unknown engine {name!r}; engines are {OWN_ENGINE} (this one) and "
                         f"{', '.join(sorted(points)) or 'none installed'} (entry points of group {GROUP})")
    try:
        cls = points[name].load()
    except Exception as err:                       # a broken third-party package: say which and why
        raise ValueError(f"{where}: engine {name!r} ({points[name].value}) failed to load: "
                         f"{type(err).__name__}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, OutsideEngine)) or cls.name != name:
        raise ValueError(f"{where}: engine {name!r} ({points[name].value}) is not an OutsideEngine subclass "
                         f"with name = {name!r} (ablate.engines.contract)")
    return cls
