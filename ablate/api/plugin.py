"""What every technique declares: its slot, name, config, needs, exactness, quality bound, stats
and figures.

A plugin is a class; its entry point (group `ablate.plugins`, named `<slot>.<name>`) names the
class. The core's baselines are plugins too, found the same way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ablate.api.context import BuildContext


class Slot(str, enum.Enum):
    """The engine's five slots; the value is the Hydra config group that picks the plugin."""

    MODEL = "variant"          # model variants (GQA/MQA conversion, MLA) applied to the loaded model
    KV_CACHE = "kv_cache"
    ATTENTION = "attention"
    SCHEDULER = "scheduler"
    DECODING = "decoding"


@dataclass
class PluginConfig:
    """Base of every plugin's config dataclass: `name` picks the plugin within its slot. Subclasses
    comment every field and validate it in __post_init__ (a ValueError naming `<slot>.<field>`)."""

    name: str = ""


@dataclass(frozen=True)
class Requirement:
    """This plugin only works when `slot` holds one of `names`, because of `reason`."""

    slot: Slot
    names: frozenset[str]
    reason: str


QUALITY_METRICS = ("perplexity",)


@dataclass(frozen=True)
class QualityBound:
    """How much a plugin that is not exact may cost, and how the conformance kit measures it.

    The kit scores one seeded text of `num_tokens` tokens by teacher forcing through the baseline's
    engine and through the plugin's (options `config` on top of its defaults) and requires
    perplexity(plugin) / perplexity(baseline) <= max_ratio. `config` lets the check engage the
    technique on a short text (a small window, say), since the kit runs on a tiny model.
    """

    max_ratio: float                       # largest acceptable perplexity ratio to the baseline's (>= 1)
    num_tokens: int = 128                  # length of the scored text: long enough that the technique acts
    config: dict[str, Any] = field(default_factory=dict)   # the plugin's options for the check
    metric: str = "perplexity"             # the only metric the kit measures so far

    def __post_init__(self) -> None:
        if self.metric not in QUALITY_METRICS:
            raise ValueError(f"QualityBound.metric must be one of {QUALITY_METRICS}, got {self.metric!r}")
        if not self.max_ratio >= 1:
            raise ValueError(f"QualityBound.max_ratio must be >= 1 (the baseline's own ratio), got {self.max_ratio}")
        if self.num_tokens < 2:
            raise ValueError(f"QualityBound.num_tokens must be >= 2 (one token predicts the next), got {self.num_tokens}")


UNITS = ("", "count", "tokens", "bytes", "ms", "ratio", "fraction", "x", "text")
AGGREGATES = ("median", "max", "min", "first")


@dataclass(frozen=True)
class Stat:
    """One figure a plugin reports in `stats()`: results column `<slot>.<key>`.

    The report formats it by `unit` (bytes as B, KiB or MiB; count and tokens as numbers; fraction
    as a percentage; x as a factor; text as is), combines the repeats of an arm by `aggregate`,
    shows it in the table headed `table` (if any) and, when it `predicts` a measured column (e.g.
    kv_util_mean), beside that column as "measured (predicted)" and as a dotted series in its figure.
    """

    key: str
    description: str
    unit: str = ""             # one of UNITS: "" for a plain number, "text" for a label
    aggregate: str = "median"  # one of AGGREGATES: how the repeats of an arm combine
    table: str = ""            # heading of the report table that shows it; "" -> only in the CSVs and W&B
    predicts: str = ""         # the measured results column it is a prediction of

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"Stat {self.key!r}: unit must be one of {UNITS}, got {self.unit!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"Stat {self.key!r}: aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if self.unit == "text" and self.aggregate != "first":
            raise ValueError(f"Stat {self.key!r}: a text stat aggregates by 'first'")


@dataclass(frozen=True)
class StatFigure:
    """A figure the report draws from a plugin's stats: `series` against `x`, one line per value
    of `group_by`. Names are this plugin's stat keys or results columns (e.g. "speedup"); the
    figure is drawn when the arms span several values of `x` and hold at least one series."""

    name: str                      # the PNG's file name and the report's anchor
    title: str
    x: str
    series: tuple[str, ...]
    ylabel: str
    caption: str
    group_by: str = ""             # a text stat whose values split the lines (e.g. the drafter)


def final(method):
    """Marks a slot base class's method that the core calls and a plugin must not override: a class
    that defines it is refused when it is created (Plugin.__init_subclass__), naming the method."""
    method.__ablate_final__ = True
    return method


class Plugin:
    """Base of every slot's plugin class (ablate.api.slots). Declarations are class attributes."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:
            for name, attr in vars(base).items():
                if getattr(attr, "__ablate_final__", False) and name in vars(cls):
                    raise TypeError(f"{cls.__module__}.{cls.__qualname__} overrides {base.__name__}.{name}, which "
                                    f"the core calls and a plugin must not override; implement the methods "
                                    f"{base.__name__} leaves to plugins instead (see its docstring)")

    slot: ClassVar[Slot]
    name: ClassVar[str]
    config_class: ClassVar[type[PluginConfig]] = PluginConfig
    exact: ClassVar[bool] = True              # greedy tokens equal the baseline's, token for token
    quality: ClassVar[QualityBound | None] = None   # not exact: what it may cost (the kit checks it)
    requires: ClassVar[tuple[Requirement, ...]] = ()
    reported_stats: ClassVar[tuple[Stat, ...]] = ()   # what stats() returns, key for key
    figures: ClassVar[tuple[StatFigure, ...]] = ()    # report figures drawn from those stats

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"{self.slot.value}={self.name}"

    def stats(self) -> dict[str, float | str]:
        """The values of `reported_stats`, key for key, for the run just served."""
        return {}

    def close(self) -> None:
        """Free what the plugin holds (tensors, threads) when its arm is done."""


class PluginError(RuntimeError):
    """A plugin broke the engine's contract (or failed inside one of its methods): the message names
    the plugin as `<slot>=<name>.<method>` and the rule it broke."""

    def __init__(self, plugin: Plugin | str, method: str, problem: str) -> None:
        self.plugin = str(plugin)
        self.method = method
        super().__init__(f"{self.plugin}.{method}: {problem}")


class blame:
    """`with blame(plugin, method): ...` runs a call into a plugin: a failure inside it becomes a
    PluginError naming the plugin and the method (a ValueError, a bad option or input the plugin
    reports itself, passes through). A class, not a generator: it wraps calls made every step."""

    __slots__ = ("plugin", "method")

    def __init__(self, plugin: Plugin | str, method: str) -> None:
        self.plugin, self.method = plugin, method

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        # SystemExit too: a plugin calling sys.exit fails its arm, not the whole sweep
        if kind is None or issubclass(kind, (PluginError, ValueError)) or not issubclass(kind, (Exception, SystemExit)):
            return
        raise PluginError(self.plugin, self.method, f"{kind.__name__}: {err}") from err
