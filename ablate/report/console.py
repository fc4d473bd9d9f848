"""What a job prints: its lines prefixed with the job's number in a sweep, so that the output of
`python -m ablate -m ...` says which job each line is from; and warnings, one line each.

A warning is for the user, not for a debugger: `warning(text)` prints `WARNING: <text>` on one line
of stderr (no source line, however long or multi-line the text), and every `kept_warnings()` block
open at the time keeps it, so that a job records its warnings in done.json and its report. The CLI
routes Python's warnings here too (`show_warning`, installed as warnings.showwarning).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

_keepers: list[list[str]] = []


def warning(text: str) -> None:
    line = " ".join(str(text).split())
    for kept in _keepers:
        kept.append(line)
    print(f"{job_prefix()}WARNING: {line}", file=sys.stderr, flush=True)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the CLI: the message alone, as `warning` prints it."""
    warning(str(message))


@contextmanager
def kept_warnings() -> Iterator[list[str]]:
    """The warnings given while the block runs, in order."""
    kept: list[str] = []
    _keepers.append(kept)
    try:
        yield kept
    finally:
        _keepers.remove(kept)


def job_prefix() -> str:
    """'[job N] ' inside a Hydra multirun (N = hydra.job.num), '' in a single run, outside Hydra, or
    when Hydra's config cannot be read."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return ""
        hydra = HydraConfig.get()
        if hydra.mode != RunMode.MULTIRUN:
            return ""
        return f"[job {hydra.job.num}] "
    except Exception:
        return ""
