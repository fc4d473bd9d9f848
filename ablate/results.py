"""The results store: results/<experiment>/<run-id>/, written atomically, read back with pandas.

A run folder holds config.json (the resolved config), environment.json (versions, device, git
commit), runs.csv (grid point x arm x repeat), requests.csv (one row per request), summary.csv
(grid point x arm) and report.md. The run id is a hash of the resolved config and the device it
ran on (ablate.experiment.job.run_identity: a CPU run never stands for a GPU run), so a re-run of the
same config on the same device finds its finished folder and is skipped unless asked to redo it;
nothing finished is ever overwritten silently (a redo moves the old folder aside).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Any

import pandas as pd

DONE = "done.json"
TABLES = ("runs", "requests", "summary")


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file.

    The file gets the mode an ordinary write would (0666 less the umask, e.g. 0644), not mkstemp's
    0600: results are for other people to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            umask = os.umask(0o022)     # reading the umask means setting it: put it straight back
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_file_atomic(path: Path, write: Callable[[str], object]) -> None:
    """`write(temporary path)` beside `path`, then rename: a reader never sees half a file. The writer
    creates the file itself, so it gets an ordinary file's mode (0666 less the umask)."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{path.suffix}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def code_version() -> str:
    """What code measured: the git commit, + a hash of the uncommitted diff when the tree is dirty;
    outside a git checkout, the installed versions of ablate and of every plugin distribution."""
    commit = _git("rev-parse", "HEAD")
    if commit:
        diff = _git("diff", "HEAD")
        return commit[:12] + (f"+dirty.{hashlib.sha256(diff.encode()).hexdigest()[:8]}" if diff else "")
    dists = {ep.dist.name: ep.dist.version for ep in entry_points(group="ablate.plugins") if ep.dist is not None}
    return ",".join(f"{name}=={v}" for name, v in sorted(({"ablate": _version("ablate")} | dists).items()))


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment(device_info: dict[str, Any]) -> dict[str, Any]:
    versions = {pkg: _version(pkg) for pkg in ("ablate", "torch", "triton", "hydra-core", "omegaconf", "wandb",
                                                 "pandas", "numpy", "scipy")}
    return {"python": platform.python_version(), "platform": platform.platform(), "versions": versions,
            "git_commit": _git("rev-parse", "HEAD"), "code_version": code_version(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **device_info}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class RunLocked(RuntimeError):
    """Another process is measuring the same config into the same folder."""


@dataclass
class RunFolder:
    path: Path

    @classmethod
    def for_config(cls, root: Path, experiment: str, config: dict[str, Any]) -> RunFolder:
        return cls(Path(root) / experiment / config_hash(config))

    @property
    def is_done(self) -> bool:
        return (self.path / DONE).exists()

    @property
    def code_version(self) -> str | None:
        """The code_version an earlier attempt recorded in environment.json (None: no readable record)."""
        try:
            return json.loads((self.path / "environment.json").read_text()).get("code_version")
        except (OSError, ValueError):
            return None

    def measured_rounds(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(runs, requests) an earlier, unfinished attempt persisted round by round; empty when none."""
        frames = []
        for name in ("runs", "requests"):
            file = self.path / f"{name}.csv"
            try:
                frames.append(pd.read_csv(file) if file.exists() and file.stat().st_size > 1 else pd.DataFrame())
            except (OSError, ValueError, pd.errors.ParserError):
                frames.append(pd.DataFrame())
        return frames[0], frames[1]

    @contextlib.contextmanager
    def lock(self):
        """Held while a process measures this config: a second process running the same config at
        the same time is refused (both would measure on a shared machine and the last writer would
        win). The lock is the kernel's (flock), so a killed process never leaves it behind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f".{self.path.name}.lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise RunLocked(f"{holder} is measuring this config right now ({self.path}): wait for it to "
                                "finish (this run is then skipped as finished) or give another results_dir") from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"process {os.getpid()} on {platform.node()}")
            handle.flush()
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def set_aside(self, why: str) -> Path:
        """Move this folder to <id>.old-<time> (nothing measured is deleted); returns where. A second one
        within the same second gets a suffix: moving onto an existing folder would nest it inside."""
        stamp = f"{self.path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        aside, n = self.path.with_name(stamp), 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{stamp}-{n}")
        shutil.move(self.path, aside)
        print(f"{why}: the earlier results moved to {aside}")
        return aside

    def start(self, config: dict[str, Any], env: dict[str, Any], redo: bool = False) -> None:
        if self.path.exists() and redo:
            self.set_aside("redo=true")
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "failed.json").unlink(missing_ok=True)    # an earlier attempt's failure, tried again
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
