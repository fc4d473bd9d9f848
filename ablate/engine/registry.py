"""Plugin discovery through entry points (group `ablate.plugins`), and their Hydra configs.

Built-in and third-party plugins are found the same way. Like pluggy: a plugin that fails to load
is a warning naming it and its error (never a crash of the rest), a plugin can be blocked by name,
and `python -m ablate plugins` lists what was found and which distribution (package) supplied it.
Two distributions supplying the same `slot.name` make that name ambiguous: choosing it is refused,
naming both, until one is blocked (`ABLATE_BLOCK_PLUGINS=<distribution>:<slot>.<name>`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from ablate.api.plugin import Plugin, PluginConfig, Slot

GROUP = "ablate.plugins"
# comma-separated entries to skip: `slot.name`, an entry point's name, or either qualified by the
# distribution that declares it, `<distribution>:slot.name` (what tells two same-named plugins apart)
BLOCK_ENV = "ABLATE_BLOCK_PLUGINS"
NOT_INSTALLED = "(not installed)"     # the source of a plugin class added by Registry.with_plugins


@dataclass
class PluginInfo:
    entry_point: str       # the entry point's name
    target: str            # module:Class it names
    source: str            # the distribution (package) that declares it
    status: str            # loaded | blocked | ambiguous: ... | error: ...
    slot: str = "?"
    name: str = "?"
    cls: type[Plugin] | None = None
    version: str | None = None           # the distribution's version


@dataclass(frozen=True)
class PluginDistribution:
    """Which installed distribution supplied a plugin, and the files of the code that runs it."""

    name: str                  # as its metadata spells it (e.g. ablate-kv-cache); NOT_INSTALLED for a class under test
    version: str | None
    # every file of the import package the plugin's class was loaded from, sorted: the code that runs
    # (an editable install records only a .pth in its metadata, so the files come from the import)
    files: tuple[Path, ...]


class UnknownPlugin(ValueError):
    pass


class AmbiguousPlugin(ValueError):
    """Two distributions supply the same slot and name."""


class Registry:
    def __init__(self, infos: list[PluginInfo]) -> None:
        self.infos = infos
        self._loaded: dict[tuple[Slot, str], PluginInfo] = {
            (i.cls.slot, i.cls.name): i for i in infos if i.status == "loaded" and i.cls is not None
        }
        self.plugins: dict[tuple[Slot, str], type[Plugin]] = {key: i.cls for key, i in self._loaded.items()}

    def with_plugins(self, *classes: type[Plugin]) -> Registry:
        """This registry plus plugin classes not installed as packages: a plugin under test (the
        conformance kit runs on it before it is packaged)."""
        infos = []
        for cls in classes:
            problem = _check_plugin_class(cls)
            if problem:
                raise ValueError(f"{cls!r} is not a valid plugin: {problem}")
            infos.append(PluginInfo(f"{cls.slot.value}.{cls.name}", f"{cls.__module__}:{cls.__qualname__}",
                                    NOT_INSTALLED, "loaded", cls.slot.value, cls.name, cls))
        return Registry([*self.infos, *infos])

    def choices(self, slot: Slot) -> list[str]:
        return sorted(name for s, name in self.plugins if s is slot)

    def get(self, slot: Slot, name: str) -> type[Plugin]:
        if (slot, name) not in self.plugins:
            rivals = [i for i in self.infos
                      if i.status.startswith("ambiguous") and (i.slot, i.name) == (slot.value, name)]
            if rivals:
                raise AmbiguousPlugin(_ambiguity(slot.value, name, rivals))
            raise UnknownPlugin(
                f"unknown {slot.value} plugin {name!r}; valid choices: {', '.join(self.choices(slot)) or 'none'}"
                + self._why_missing(slot, name)
            )
        return self.plugins[(slot, name)]

    def distribution(self, slot: Slot, name: str) -> PluginDistribution:
        """Which distribution supplied plugin `slot=name` (its name, version and code files); raises as
        get() does for a plugin that is not loaded."""
        cls = self.get(slot, name)
        info = self._loaded[(slot, name)]
        return PluginDistribution(info.source, info.version, _import_package_files(cls.__module__))

    def _why_missing(self, slot: Slot, name: str) -> str:
        for info in self.infos:
            if info.status != "loaded" and name in (info.name, info.entry_point.split(".")[-1]) \
                    and info.slot in (slot.value, "?"):
                why = f" ({info.entry_point} from {info.source} is {info.status})"
                if info.status == "blocked" and _block_names(info) & _env_blocked():
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
        return [{"slot": i.slot, "name": i.name, "source": i.source, "version": i.version or "?", "status": i.status,
                 "target": i.target}
                for i in sorted(self.infos, key=lambda i: (i.slot, i.name, i.source))]


def _load(ep: EntryPoint) -> PluginInfo:
    source, version = _distribution_of(ep)
    info = PluginInfo(ep.name, ep.value, source, "loaded", *_declared(ep.name), version=version)
    try:
        cls = ep.load()
    except KeyboardInterrupt:
        raise                  # the user's Ctrl-C, not the plugin's doing
    except BaseException as err:   # a broken plugin must not break the others, not even by exiting
        info.status = f"error: {_describe(err)}"
        return info
    problem = _check_plugin_class(cls)
    if problem:
        info.status = f"error: {problem}"
        return info
    info.slot, info.name, info.cls = cls.slot.value, cls.name, cls
    return info


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):    # sys.exit() at import would otherwise end ablate silently, status 0
        return f"SystemExit: it calls sys.exit({err.code!r}) when imported"
    return f"{type(err).__name__}: {err}"


def _distribution_of(ep: EntryPoint) -> tuple[str, str | None]:
    """The name and version of the distribution declaring `ep` ("?" when it has none, as a test's)."""
    if ep.dist is None:
        return "?", None
    return ep.dist.name, ep.dist.version


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


def _canonical(distribution: str) -> str:
    """A distribution's name as packaging compares them (PEP 503): ablate_KV.cache == ablate-kv-cache."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _canonical_entry(entry: str) -> str:
    distribution, colon, name = entry.partition(":")
    return f"{_canonical(distribution)}:{name}" if colon else entry


def _env_blocked() -> set[str]:
    return {_canonical_entry(b.strip()) for b in os.environ.get(BLOCK_ENV, "").split(",") if b.strip()}


def _block_names(info: PluginInfo) -> set[str]:
    """Every block-list entry that names this plugin."""
    names = {info.entry_point, f"{info.slot}.{info.name}"}
    return names | {f"{_canonical(info.source)}:{name}" for name in names}


def _import_package_files(module: str) -> tuple[Path, ...]:
    """Every file of the outermost regular package holding `module` (byte-code caches aside); the
    module's own file when no regular package holds it (a namespace package has no folder of its own)."""
    parts = module.split(".")
    for depth in range(1, len(parts)):
        where = getattr(sys.modules.get(".".join(parts[:depth])), "__file__", None)
        if where is not None and Path(where).name == "__init__.py":
            folder = Path(where).resolve().parent
            return tuple(sorted(p for p in folder.rglob("*")
                                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"))
    where = getattr(sys.modules.get(module), "__file__", None)
    return (Path(where).resolve(),) if where is not None else ()


def _ambiguity(slot: str, name: str, rivals: list[PluginInfo]) -> str:
    supplied = " and ".join(f"{i.source} {i.version or '?'} ({i.target})" for i in rivals)
    if len({_canonical(i.source) for i in rivals}) == len(rivals):
        keep = rivals[0]
        block = ",".join(f"{_canonical(i.source)}:{slot}.{name}" for i in rivals if i is not keep)
        how = f"keep one by blocking the others, e.g. {BLOCK_ENV}={block} keeps {keep.source}'s"
    else:
        points = ", ".join(i.entry_point for i in rivals)
        how = f"keep one by blocking the others' entry points in {BLOCK_ENV} ({points})"
    return f"{slot}={name} is ambiguous: supplied by {supplied}; {how}, or uninstall one"


def _mark_ambiguous(infos: list[PluginInfo]) -> None:
    """Two loaded plugins of one slot and name are both refused: which one a run measured would
    otherwise depend on the order entry points are listed in."""
    by_key: dict[tuple[str, str], list[PluginInfo]] = defaultdict(list)
    for info in infos:
        if info.status == "loaded":
            by_key[(info.slot, info.name)].append(info)
    for (slot, name), rivals in by_key.items():
        if len(rivals) < 2:
            continue
        for info in rivals:
            others = ", ".join(f"{o.source} ({o.target})" for o in rivals if o is not info)
            info.status = f"ambiguous: {slot}={name} is also supplied by {others}"
        warnings.warn(f"ablate: {_ambiguity(slot, name, rivals)}", stacklevel=3)


def discover(blocked: tuple[str, ...] = ()) -> Registry:
    """Load every plugin of the entry-point group; warn about (never raise for) broken ones."""
    env_blocked = _env_blocked()
    blocked_names = {_canonical_entry(b) for b in blocked} | env_blocked
    infos: list[PluginInfo] = []
    classes: set[type] = set()
    failures: set[tuple[str, str]] = set()
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        source, version = _distribution_of(ep)
        if {ep.name, f"{_canonical(source)}:{ep.name}"} & blocked_names:   # never imported
            infos.append(PluginInfo(ep.name, ep.value, source, "blocked", *_declared(ep.name), version=version))
            continue
        info = _load(ep)
        if info.cls in classes or (info.target, info.status) in failures:
            continue   # one plugin declared twice (an editable install beside a regular one): not a rival
        if info.cls is not None:
            classes.add(info.cls)
        if info.status == "loaded" and _block_names(info) & blocked_names:
            info.status = "blocked"
        elif info.status.startswith("error"):
            failures.add((info.target, info.status))
            warnings.warn(f"ablate: plugin {ep.name!r} ({ep.value}, from {source} {version or '?'}) could not be "
                          f"loaded and is skipped: {info.status.removeprefix('error: ')}", stacklevel=2)
        infos.append(info)
    _mark_ambiguous(infos)
    names = set().union(*(_block_names(i) for i in infos))
    unknown = sorted(env_blocked - names)
    if unknown:    # a typo would otherwise block nothing, silently
        raise ValueError(f"{BLOCK_ENV}={os.environ[BLOCK_ENV]}: {', '.join(unknown)} names no plugin; entries are "
                         "slot.name or <distribution>:slot.name, e.g. kv_cache.paged or "
                         "ablate-kv-cache:kv_cache.paged (python -m ablate plugins lists them)")
    return Registry(infos)


def conf_dir() -> Path:
    """The Hydra config shipped with the package (ablate/conf: the repository's conf/)."""
    return Path(__file__).resolve().parents[1] / "conf"


@cache
def default_registry() -> Registry:
    return discover()
