"""The contract of an outside engine: another inference engine (transformers, llama.cpp, vLLM, a
server) that serves the workload of an experiment beside ablate's own arms.

An experiment names one in an arm, `{engine: {name: hf, cache: static}}`; the class is found through
the `ablate.engines` entry points (ablate.outside.discovery), so a user's engine is added the way a
plugin is. It gets the experiment's model (its weights, when it can run them: the same numbers, so
that ablate's greedy tokens are the reference) and its batch limit, and serves the requests,
reporting when each one arrived, was scheduled, emitted tokens and finished (a Timeline).
"""
from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ablate.api.sequence import Request
from ablate.outside.timeline import Timeline
from ablate.model.llama import LlamaModel


class OutsideEngineError(RuntimeError):
    """An outside engine failed while serving: its arm is recorded as failed, with this reason."""


@dataclass(frozen=True)
class Option:
    default: Any
    help: str
    choices: tuple[Any, ...] = ()     # the allowed values; empty: any value of the default's type

    def check(self, where: str, value: Any) -> Any:
        if self.choices and value not in self.choices:
            raise ValueError(f"{where} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        kind = (int, float) if isinstance(self.default, float) else type(self.default)   # YAML writes 600.0 as 600
        if not self.choices and (isinstance(value, bool) != isinstance(self.default, bool)
                                 or not isinstance(value, kind)):
            raise ValueError(f"{where} must be a {type(self.default).__name__} ({self.help}), got {value!r}")
        return value


class OutsideEngine(ABC):
    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()     # modules it imports: one missing means the arm is skipped
    extra: ClassVar[str] = ""                    # the pip extra that installs them: pip install -e ".[extra]"
    options: ClassVar[dict[str, Option]] = {}
    # served from a worker process of its own (ablate.outside.worker), so that a crash of its native
    # code fails its arm only; False for an engine that is only a client of a process apart (a server)
    in_worker: ClassVar[bool] = True

    def __init__(self, options: dict[str, Any], model: LlamaModel, max_batch: int) -> None:
        """`options` resolved by resolve_options; `model` the experiment's (ablate's) model;
        `max_batch` the experiment's engine.max_num_seqs, the same limit ablate's arms run under."""
        self.opts = options
        self.model = model
        self.max_batch = max_batch

    @classmethod
    def missing(cls) -> str | None:
        """Why the engine cannot run here (a module it needs is not installed), in one line; None if it can."""
        absent = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        if not absent:
            return None
        return (f"engine={cls.name} needs {', '.join(absent)}, which is not installed"
                + (f" (pip install -e \".[{cls.extra}]\")" if cls.extra else ""))

    @classmethod
    def resolve_options(cls, where: str, raw: dict[str, Any]) -> dict[str, Any]:
        """Every option with its value (the default where not given); an unknown option or a bad value
        is a ValueError naming it and what is allowed."""
        unknown = sorted(set(raw) - set(cls.options))
        if unknown:
            allowed = "; ".join(f"{k} ({o.help}, default {o.default!r})" for k, o in cls.options.items()) or "none"
            raise ValueError(f"{where}: engine={cls.name} has no option {', '.join(unknown)}; its options: {allowed}")
        return {k: o.check(f"{where}.{k}", raw.get(k, o.default)) for k, o in cls.options.items()}

    @classmethod
    def is_exact(cls, options: dict[str, Any]) -> bool:
        """True when, with these options, its greedy tokens must equal ablate's on the same model (the
        same weights in the same precision): the experiment then checks them as it checks an exact
        plugin, up to rounding. False (the default): token agreement is reported as its quality cost."""
        return False

    def describe(self) -> dict[str, str]:
        """What the arm ran, for its row: precision, weights, batching."""
        return {}

    @abstractmethod
    def serve(self, requests: Sequence[Request], timeline: Timeline) -> dict[int, list[int]]:
        """Serve every request from its arrival time on (seconds after the call; follow-up requests of
        a closed loop when the one they follow finished), recording each one's times in `timeline`.
        Returns each request's output tokens: at most max_new_tokens, ending at a stop token if one came."""

    def weight_bytes(self) -> int:
        """Bytes of the weights as it holds them."""
        return self.model.weight_bytes()

    def memory_bytes(self) -> int | None:
        """Its own figure for the memory the weights and the KV cache take, where it has one."""
        return None

    def close(self) -> None:
        """Give back what it holds (a worker process, a loaded model)."""
