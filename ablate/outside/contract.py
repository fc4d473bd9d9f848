"""The contract of an outside engine: another inference engine (transformers, llama.cpp, vLLM, a
server) that serves the workload of an experiment beside ablate's own arms.

An experiment names one in an arm, `{engine: {name: hf, cache: static}}`; the class is found through
the `ablate.engines` entry points (ablate.outside.discovery), so a user's engine is added the way a
plugin is. It gets the experiment's model (its weights, when it can run them: the same numbers, so
that ablate's greedy tokens are the reference) and its batch limit, and serves the requests,
reporting when each one arrived, was scheduled, emitted tokens and finished (a Timeline).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ablate.api.sequence import Request
from ablate.field_types import check_field_types
from ablate.outside.timeline import Timeline
from ablate.model.llama import LlamaModel


class OutsideEngineError(RuntimeError):
    """An outside engine failed while serving: its arm is recorded as failed, with this reason."""


HOW_TO_DECLARE = ("an outside engine declares its options as its `config_class`: a dataclass deriving from "
                  "ablate.outside.contract.OutsideEngineConfig, `name` defaulting to the engine's, one field per "
                  "option with its type and option(default, help), e.g. `cache: str = option(\"dynamic\", \"the KV "
                  "cache it keeps\")`; bad values refused in __post_init__ (docs/outside-engines.md, "
                  "\"Writing an outside engine\")")


def __getattr__(name: str) -> Any:
    if name == "Option":    # an engine written against the `options` dict of Option: refused at load, saying how now
        raise ImportError(f"ablate.outside.contract.Option is gone: {HOW_TO_DECLARE}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def option(default: Any, help: str) -> Any:
    """A field of an OutsideEngineConfig: its default and what it does, which `python -m ablate plugins`
    lists and the message for an unknown option repeats."""
    return field(default=default, metadata={"help": help})


@dataclass
class OutsideEngineConfig:
    """Base of an outside engine's config dataclass (its `config_class`), as PluginConfig is a plugin's:
    `name` defaults to the engine's; every other field is an option an arm may set, `{engine: {name: hf,
    cache: static}}`, declared with its type and `option(default, help)`. A value not of its field's type
    (bool, int, float, str, maybe optional) is refused before the dataclass is built (ablate.field_types);
    a bad value of the right type is refused by __post_init__ with a ValueError that begins with the
    option's name (`cache must be one of dynamic, static, got 'paged'`), which resolve_options prefixes
    with where the arm set it."""

    name: str = ""

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        """Its options: every field but `name`."""
        return [f for f in dataclasses.fields(cls) if f.name != "name"]

    @classmethod
    def summary(cls) -> str:
        """`cache (the KV cache transformers keeps, default 'dynamic'); prompt_lookup (...)`, or none."""
        return "; ".join(f"{f.name} ({f.metadata.get('help') or f.type}, default {f.default!r})"
                         for f in cls.options()) or "none"


class OutsideEngine(ABC):
    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()     # modules it imports: one missing means the arm is skipped
    extra: ClassVar[str] = ""                    # the pip extra that installs them: pip install -e ".[extra]"
    config_class: ClassVar[type[OutsideEngineConfig]] = OutsideEngineConfig    # its options (HOW_TO_DECLARE)
    # served from a worker process of its own (ablate.outside.worker), so that a crash of its native
    # code fails its arm only; False for an engine that is only a client of a process apart (a server)
    in_worker: ClassVar[bool] = True

    def __init__(self, config: OutsideEngineConfig, model: LlamaModel, max_batch: int) -> None:
        """`config` its config_class's, built by resolve_options; `model` the experiment's (ablate's)
        model; `max_batch` the experiment's engine.max_num_seqs, the same limit ablate's arms run under."""
        self.config = config
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
    def declaration_problem(cls) -> str | None:
        """What is wrong with how the class declares its options, in one line; None if nothing (checked
        when it is loaded, ablate.outside.discovery). An engine without options may leave config_class out."""
        if isinstance(getattr(cls, "options", None), dict):        # the declaration before config_class
            return f"declares `options`, which ablate no longer reads: {HOW_TO_DECLARE}"
        config = cls.config_class
        if not (isinstance(config, type) and dataclasses.is_dataclass(config) and issubclass(config, OutsideEngineConfig)):
            return (f"has config_class {getattr(config, '__name__', repr(config))}, which is not a dataclass deriving "
                    f"from OutsideEngineConfig: {HOW_TO_DECLARE}")
        fields = {f.name: f for f in dataclasses.fields(config)}
        if config is not OutsideEngineConfig and fields["name"].default != cls.name:
            return f"has config_class {config.__name__}, whose name defaults to {fields['name'].default!r}, not {cls.name!r}"
        required = [k for k, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if required:
            return f"has config_class {config.__name__}, whose options {', '.join(required)} have no default"
        return None

    @classmethod
    def resolve_options(cls, where: str, raw: dict[str, Any]) -> OutsideEngineConfig:
        """Its config_class built from an arm's options (the defaults where not given): an unknown option
        is a ValueError naming them all, a value of the wrong type ablate.field_types', a bad value its
        __post_init__'s, each prefixed with `where`."""
        known = [f.name for f in cls.config_class.options()]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{where}: engine={cls.name} has no option {', '.join(unknown)}; "
                             f"its options: {cls.config_class.summary()}")
        check_field_types(cls.config_class, raw, f"{where}.")
        try:
            return cls.config_class(name=cls.name, **raw)
        except (ValueError, TypeError) as err:   # `cache must be one of ...`: where.cache; any other: where: ...
            joint = "." if str(err).split(" ", 1)[0] in known else ": "
            raise ValueError(f"{where}{joint}{err}") from err

    @classmethod
    def is_exact(cls, config: OutsideEngineConfig) -> bool:
        """True when, with this config, its greedy tokens must equal ablate's on the same model (the
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
