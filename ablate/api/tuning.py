"""Choices a plugin makes by timing on the machine it runs on (a kernel per kind of input), told to
the core: each timing is counted, so that a run whose time holds one is flagged (runs.csv's
path_timings, with the CPU product paths' own), and each choice is listed with the run's results
(environment.json's `tuned`)."""
from __future__ import annotations

_count = [0]                                    # timings so far in this process
_choices: dict[str, dict[str, str]] = {}        # who chose -> kind of input -> what and why


def timed(count: int = 1) -> None:
    """A plugin ran `count` timings (inside whatever run is being measured)."""
    _count[0] += count


def timings() -> int:
    """Timings plugins ran so far in this process."""
    return _count[0]


def chose(owner: str, key: str, choice: str) -> None:
    """`owner` (e.g. "attention=paged decode") chose `choice` (e.g. "native (timed: ...)") for `key`."""
    _choices.setdefault(owner, {})[key] = choice


def choices() -> dict[str, dict[str, str]]:
    """Every choice told so far: owner -> key -> choice."""
    return {owner: dict(keys) for owner, keys in _choices.items()}
