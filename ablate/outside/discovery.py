"""Outside engines are found through the entry points of group `ablate.engines`, as plugins are
through `ablate.plugins`: `hf = "ablate.outside.hf:HFGenerate"` in a package's pyproject.toml."""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from ablate.engine.arm import OWN_ENGINE
from ablate.outside.contract import OutsideEngine

GROUP = "ablate.engines"


def engine_names() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def _supplier(ep: EntryPoint) -> str:
    """`ep`'s value and the distribution declaring it, for messages: `mod:Class from dist 1.0`."""
    return f"{ep.value} from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ep.value


def load_engine(where: str, name: str) -> type[OutsideEngine]:
    """The class of outside engine `name`; a ValueError naming the known ones when there is none,
    naming the distributions when two declare it, or naming the entry point when it does not load,
    does not give an OutsideEngine or declares its options otherwise than as a config_class."""
    points = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not points:
        raise ValueError(f"{where}: unknown engine {name!r}; engines are {OWN_ENGINE} (this one) and "
                         f"{', '.join(engine_names()) or 'none installed'} (entry points of group {GROUP})")
    if len({ep.value for ep in points}) > 1:          # which one ran would depend on the listing's order
        raise ValueError(f"{where}: engine {name!r} is ambiguous: declared by {' and '.join(map(_supplier, points))}; "
                         f"uninstall all but one")
    point = points[0]
    try:
        cls = point.load()
    except KeyboardInterrupt:
        raise
    except BaseException as err:     # a broken third-party package, even one calling sys.exit: say which and why
        what = (f"SystemExit: it calls sys.exit({err.code!r}) when imported" if isinstance(err, SystemExit)
                else f"{type(err).__name__}: {err}")
        raise ValueError(f"{where}: engine {name!r} ({_supplier(point)}) failed to load: {what}") from None
    if not (isinstance(cls, type) and issubclass(cls, OutsideEngine)) or cls.name != name:
        raise ValueError(f"{where}: engine {name!r} ({_supplier(point)}) is not an OutsideEngine subclass "
                         f"with name = {name!r} (ablate.outside.contract)")
    problem = cls.declaration_problem()
    if problem:
        raise ValueError(f"{where}: engine {name!r} ({_supplier(point)}) {problem}")
    return cls
