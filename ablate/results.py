"""The results store: results/<experiment>/<run-id>/, written atomically, read back with pandas.

A run folder holds config.json (the resolved config), environment.json (versions, device, git
commit), runs.csv (grid point x arm x repeat), requests.csv (one row per request), summary.csv
(grid point x arm) and report.md. The run id is a hash of the resolved config, so a re-run of the
same config finds its finished folder and is skipped unless asked to redo it; nothing finished is
ever overwritten silently (a redo moves the old folder aside).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd

DONE = "done.json"
TABLES = ("runs", "requests", "summary")


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def environment(device_info: dict[str, Any]) -> dict[str, Any]:
    versions = {}
    for pkg in ("ablate", "torch", "triton", "hydra-core", "omegaconf", "wandb", "pandas", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {"python": platform.python_version(), "platform": platform.platform(), "versions": versions,
            "git_commit": _git_commit(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **device_info}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class RunFolder:
    path: Path

    @classmethod
    def for_config(cls, root: Path, experiment: str, config: dict[str, Any]) -> RunFolder:
        return cls(Path(root) / experiment / config_hash(config))

    @property
    def is_done(self) -> bool:
        return (self.path / DONE).exists()

    def start(self, config: dict[str, Any], env: dict[str, Any], redo: bool = False) -> None:
        if self.path.exists() and redo:
            aside = self.path.with_name(f"{self.path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(self.path, aside)
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path / "config.json", json.dumps(config, indent=2, sort_keys=True, default=str))
        write_atomic(self.path / "environment.json", json.dumps(env, indent=2, default=str))

    def write_table(self, name: str, frame: pd.DataFrame) -> None:
        write_atomic(self.path / f"{name}.csv", frame.to_csv(index=False))

    def write_text(self, name: str, text: str) -> None:
        write_atomic(self.path / name, text)

    def finish(self, status: str = "done", error: str | None = None, **extra: Any) -> None:
        name = DONE if status == "done" else "failed.json"
        write_atomic(self.path / name, json.dumps({"status": status, "error": error, **extra}, default=str))


@dataclass
class Results:
    path: Path
    config: dict[str, Any]
    environment: dict[str, Any]
    runs: pd.DataFrame
    requests: pd.DataFrame
    summary: pd.DataFrame


def load(path: str | os.PathLike) -> Results:
    """Read a run folder back: its config, environment and tables as pandas DataFrames."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not an ablate run folder (no config.json); run folders live in "
                                "results/<experiment>/<run-id>/")
    tables = {}
    for name in TABLES:
        file = path / f"{name}.csv"
        tables[name] = pd.read_csv(file) if file.exists() and file.stat().st_size > 1 else pd.DataFrame()
    return Results(path, json.loads((path / "config.json").read_text()),
                   json.loads((path / "environment.json").read_text()), **tables)


def runs_under(root: str | os.PathLike) -> list[Path]:
    """Every finished run folder below `root`."""
    return sorted(p.parent for p in Path(root).rglob(DONE))
