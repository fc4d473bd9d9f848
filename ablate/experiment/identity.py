"""What a run measured beyond its config: the weights' bytes, the plugin packages' code and the outside
engines' versions. A finished or unfinished run is reused only when all of it is unchanged.

The run folder's id hashes the config and the device (job.run_identity), so one config keeps one
folder: `collect`, the book and `RunFolder.for_config` find the current result of a config there,
and an earlier result measured with other weights or other plugin code is moved aside (<id>.old-*,
left out of a sweep's tables) with the reason, never pooled beside it. `measured_inputs` is recorded
in environment.json (key `measured_inputs`, for the user to read) and compared by `what_changed` on
the next run of the config: any difference means measure afresh.

Weights are compared by their content (sha256), not by their file times: copying a checkpoint back
or touching it does not discard results, replacing its bytes does. Hashing a 16 GB checkpoint takes
~10 s, so each file's digest is cached under ABLATE_CACHE_DIR by (path, size, mtime_ns, inode,
ctime_ns): any write, rename onto the path or `touch` changes one of them (ctime cannot be set back
by a user), so a stale digest is never served, and an unchanged file is never hashed again.

Plugin code: each plugin distribution's version and a digest of the files of the import package its
plugin was loaded from (Registry.distribution: editable installs included), so an edited third-party
plugin is a change even at the same version. ablate's own distribution (the baselines) is left out: it is the
measuring instrument, covered by code_version (ablate.results) with its own policy.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import asdict, replace
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path
from typing import Any

from ablate.checkpoints.loader import CheckpointNotFound, checkpoint_path
from ablate.engine.arm import Arm
from ablate.engine.registry import NOT_INSTALLED, Registry
from ablate.model.config import ModelConfig
from ablate.results import write_atomic

KEY = "measured_inputs"            # its key in environment.json
CORE = "ablate"                    # the core's distribution: covered by code_version
DIGEST_CACHE = "file_digests.json"
CHUNK = 1 << 20


# -- one file's content digest, cached by what changes whenever its bytes can have changed -------------

def cache_file() -> Path:
    return Path(os.environ.get("ABLATE_CACHE_DIR") or Path.home() / ".cache" / "ablate") / DIGEST_CACHE


def file_digest(path: Path) -> dict[str, Any]:
    """{path, size, mtime_ns, sha256} of a file; the sha256 read from the cache when the file's
    (size, mtime_ns, inode, ctime_ns) are those it was hashed with."""
    path = Path(path).resolve()
    st = path.stat()
    if st.st_size < CHUNK:           # small files are hashed faster than the cache is read
        return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    cache = _read_cache()
    hit = cache.get(str(path))
    if hit and hit.get("stamp") == stamp:
        sha = hit["sha256"]
    else:
        with open(path, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        _write_cache(str(path), {"stamp": stamp, "sha256": sha})
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}


def _read_cache() -> dict[str, Any]:
    try:
        cache = json.loads(cache_file().read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}            # no cache, or a damaged one: hash again


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    try:
        write_atomic(cache_file(), json.dumps(_read_cache() | {key: entry}))
    except OSError:
        pass                 # a read-only cache folder costs a rehash next time, nothing else


def files_digest(files: tuple[Path, ...] | list[Path]) -> str:
    """One sha256 over files: each one's name (relative to their common folder) and content."""
    files = sorted(Path(f).resolve() for f in files)
    if not files:
        return "no files"
    root = Path(os.path.commonpath([f.parent for f in files]))
    h = hashlib.sha256()
    for file in files:
        h.update(str(file.relative_to(root)).encode() + b"\0" + bytes.fromhex(file_digest(file)["sha256"]))
    return h.hexdigest()[:16]


# -- the weights ----------------------------------------------------------------------------------------

def checkpoint_files(model: ModelConfig) -> list[Path]:
    """The files the model's weights and tokenizer are read from: none for random weights; a folder
    (a Hugging Face checkpoint) gives every file in it. A path that does not exist is left to the
    loader, whose error names it."""
    if model.init != "pretrained" and not (model.init == "auto" and (model.path or model.package)):
        return []
    try:
        path = checkpoint_path(model)
    except CheckpointNotFound:
        return []
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def weights(model: ModelConfig, arms: list[Arm]) -> dict[str, dict[str, Any]]:
    """Each checkpoint file the run reads (the experiment's model, arms' model fields, and a plugin
    option naming an existing file or folder, such as a draft model's path) -> its digest."""
    files = checkpoint_files(model)
    for arm in arms:
        if {"path", "package", "init"} & set(arm.model_overrides):
            try:
                files += checkpoint_files(replace(model, **arm.model_overrides))
            except TypeError:
                pass             # a bad model field: refused with its name when the arm's model is built
        for config in arm.plugins.values():
            for value in asdict(config).values():
                if isinstance(value, str) and value and os.sep in value and Path(value).expanduser().exists():
                    found = Path(value).expanduser()
                    files += sorted(p for p in found.rglob("*") if p.is_file()) if found.is_dir() else [found]
    return {str(f.resolve()): file_digest(f) for f in files}


# -- the plugin packages --------------------------------------------------------------------------------

def plugin_packages(arms: list[Arm], registry: Registry) -> dict[str, dict[str, Any]]:
    """distribution -> {version, sources, plugins} for every plugin the arms run (the registry says
    which distribution supplied each, and the files of its import package); a plugin class under test,
    not installed, is keyed by its module."""
    used = sorted({(slot, config.name) for arm in arms if arm.outside is None for slot, config in arm.plugins.items()},
                  key=lambda key: (key[0].value, key[1]))
    packages: dict[str, dict[str, Any]] = {}
    for slot, name in used:
        supplied = registry.distribution(slot, name)
        key = supplied.name
        if key == NOT_INSTALLED:
            key = f"{NOT_INSTALLED} {registry.get(slot, name).__module__}"
        sources = "code_version" if _normal(supplied.name) == CORE else files_digest(supplied.files)
        entry = packages.setdefault(key, {"version": supplied.version, "sources": sources, "plugins": []})
        entry["plugins"].append(f"{slot.value}.{name}")
    return packages


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_version(dist: str) -> str | None:
    try:
        return distribution(dist).version
    except PackageNotFoundError:
        return None


# -- the outside engines --------------------------------------------------------------------------------

def engine_versions(arms: list[Arm]) -> dict[str, dict[str, Any]]:
    """engine name -> the versions of the distributions its `requires` modules come from (what runs
    the arm), as installed in this interpreter."""
    engines = {}
    for arm in arms:
        if arm.outside is None:
            continue
        cls = arm.outside[0]
        versions = {}
        for module in cls.requires:
            dists = packages_distributions().get(module.split(".")[0], [])
            versions |= {d: _dist_version(d) for d in dists} or {module: "not installed"}
        engines[cls.name] = {"class": f"{cls.__module__}:{cls.__qualname__}", "versions": versions}
    return engines


# -- the whole record, and what differs between two ------------------------------------------------------

def measured_inputs(model: ModelConfig, arms: list[Arm], registry: Registry) -> dict[str, Any]:
    return {"weights": weights(model, arms), "plugin_packages": plugin_packages(arms, registry),
            "engines": engine_versions(arms), "python": sys.version.split()[0]}


def recorded_inputs(folder: Path) -> dict[str, Any] | None:
    """What an earlier attempt in `folder` recorded (None: no readable record, e.g. older code)."""
    try:
        recorded = json.loads((Path(folder) / "environment.json").read_text()).get(KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def what_changed(before: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """One line naming what differs between two records (None: nothing, or no record to compare)."""
    if before is None:
        return None
    changes = []
    old_w, new_w = before.get("weights") or {}, now.get("weights") or {}
    for path in sorted(set(old_w) | set(new_w)):
        old, new = (old_w.get(path) or {}).get("sha256"), (new_w.get(path) or {}).get("sha256")
        if old != new:
            changes.append(f"the weights file {path} " + (f"changed (sha256 {old[:12]} -> {new[:12]})" if old and new
                                                          else "is new" if new else "is no longer read"))
    for kind, fields in (("plugin_packages", ("version", "sources")), ("engines", ("class", "versions"))):
        old_p, new_p = before.get(kind) or {}, now.get(kind) or {}
        for name in sorted(set(old_p) | set(new_p)):
            old, new = old_p.get(name), new_p.get(name)
            what = "plugin package" if kind == "plugin_packages" else "outside engine"
            if old is None or new is None:
                changes.append(f"{what} {name} {'is new' if old is None else 'is no longer used'}")
                continue
            diff = [f"{f} {old.get(f)} -> {new.get(f)}" for f in fields if old.get(f) != new.get(f)]
            if diff:
                changes.append(f"{what} {name} changed ({'; '.join(diff)})")
    return "; ".join(changes) or None
