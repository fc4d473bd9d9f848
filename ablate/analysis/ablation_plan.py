"""An ablation's plan: what each technique buys alone, and what the full system loses without it.

The techniques are declared, not coded (conf/experiment/ablation.yaml, `experiment.ablation`):
each has a name, the arm overrides that turn it on ({slot: plugin | {name, options}, model: {field:
value}}, as an experiment's arms) and the techniques it requires (a paged cache is a KV cache:
`paged` requires `kv_cache`). An arm is a set of techniques closed under `requires`; its spec is
their overrides applied in order, requirements first, so a technique may replace what one it
requires set (paged's kv_cache=paged over kv_cache=contiguous). The arms:

  baseline   no technique: the core baselines (ablate.engine.arm.BASELINE)
  full       every technique
  +t         add-one-in: t with what it requires, over the baseline
  -t         leave-one-out: the full system without t's unit, t and every technique that requires it
             (removing the KV cache removes the paged cache too)
  +a+b ...   reference arms the arithmetic below needs that none of the above is (and, with
             `pairs: true`, every pair of techniques for the two-factor interactions)

Roles that give the same set share one arm. A set that cannot run is kept in the plan, skipped with
the reason: two techniques, neither requiring the other, that set one slot differently, or plugins
that refuse each other (ablate.engine.arm.check_compatible).

Contributions (what each technique buys, with CIs, and their interactions) are computed from
the measured arms by ablate.analysis.contributions; the experiment resolves the plan's arms against
the registry and measures them (ablate.experiment.ablation.plan_arms).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from ablate.engine.arm import ENGINE_KEY, MODEL_KEY, ArmSpec
from ablate.field_types import check_field_types

BASELINE_ARM = "baseline"
FULL_ARM = "full"
ARMS_TABLE = "ablation_arms"   # results table: every planned arm, measured or skipped with the reason

@dataclass
class Technique:
    name: str
    overrides: dict[str, Any]             # an arm spec fragment: {slot: plugin | {name, ...}, model: {...}}
    requires: tuple[str, ...] = ()        # techniques it cannot run without (names)


@dataclass
class AblationConfig:
    techniques: list[Technique]           # ordered so that each comes after what it requires
    pairs: bool = False                   # also measure every pair over the baseline (2-factor interactions)
    interaction_tolerance: float = 0.10   # a smaller relative departure from independence is not called out

    def __post_init__(self) -> None:
        if not 0 <= self.interaction_tolerance < 1:
            raise ValueError(f"experiment.ablation.interaction_tolerance must be in [0, 1), got "
                             f"{self.interaction_tolerance}")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.techniques]

    def technique(self, name: str) -> Technique:
        return next(t for t in self.techniques if t.name == name)

    def requirements(self, name: str) -> frozenset[str]:
        """What `name` requires, directly or through what it requires."""
        found: set[str] = set()
        todo = list(self.technique(name).requires)
        while todo:
            need = todo.pop()
            if need not in found:
                found.add(need)
                todo += self.technique(need).requires
        return frozenset(found)

    def unit(self, name: str) -> frozenset[str]:
        """`name` and every technique that requires it: what leaving it out removes."""
        return frozenset({name} | {t for t in self.names if name in self.requirements(t)})

    def closure(self, names: frozenset[str] | set[str]) -> frozenset[str]:
        """The techniques plus all they require: a set that can be built."""
        return frozenset(names).union(*(self.requirements(n) for n in names))

    def ordered(self, names: frozenset[str]) -> list[str]:
        return [n for n in self.names if n in names]


def parse_ablation(raw: dict[str, Any]) -> AblationConfig:
    """`experiment.ablation` (a plain dict) -> AblationConfig, refusing what cannot be meant."""
    raw = dict(raw)
    unknown = sorted(set(raw) - {"techniques", "pairs", "interaction_tolerance"})
    if unknown:
        raise ValueError(f"experiment.ablation has no field {', '.join(unknown)}; fields: techniques, pairs, "
                         "interaction_tolerance")
    declared = raw.pop("techniques", None)
    if not isinstance(declared, dict) or not declared:
        raise ValueError("experiment.ablation.techniques must map technique names to "
                         "{overrides: {slot: plugin, ...}, requires: [names]}")
    techniques = []
    for name, spec in declared.items():
        where = f"experiment.ablation.techniques.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"{where}: a technique name is letters, digits and _ (it names arms: +{name}, -{name})")
        spec = dict(spec or {})
        bad = sorted(set(spec) - {"overrides", "requires"})
        if bad:
            raise ValueError(f"{where} has no field {', '.join(bad)}; fields: overrides, requires")
        overrides = dict(spec.get("overrides") or {})
        if not overrides:
            raise ValueError(f"{where}.overrides must set at least one slot, e.g. {{kv_cache: contiguous}}")
        ArmSpec.parse(f"{where}.overrides", overrides)     # refuses unknown slots and malformed choices
        requires = spec.get("requires") or []
        if isinstance(requires, str):
            requires = [requires]
        missing = sorted(set(requires) - set(declared))
        if missing or name in requires:
            raise ValueError(f"{where}.requires names {', '.join(missing) or name}: a technique requires other "
                             f"declared techniques ({', '.join(declared)})")
        techniques.append(Technique(name, overrides, tuple(requires)))
    check_field_types(AblationConfig, raw, "experiment.ablation.")     # pairs=no would be true
    return AblationConfig(_requirements_first(techniques), **raw)


def _requirements_first(techniques: list[Technique]) -> list[Technique]:
    """Declaration order, except that a technique comes after what it requires; refuses cycles."""
    placed: list[Technique] = []
    pending = list(techniques)
    while pending:
        ready = [t for t in pending if set(t.requires) <= {p.name for p in placed}]
        if not ready:
            raise ValueError("experiment.ablation: techniques require each other in a cycle: "
                             + ", ".join(f"{t.name} requires {'+'.join(t.requires)}" for t in pending))
        placed.append(ready[0])
        pending.remove(ready[0])
    return placed


class OverrideConflict(ValueError):
    """Two techniques of one arm set the same slot (or model field) differently."""


def arm_spec(cfg: AblationConfig, techniques: frozenset[str]) -> dict[str, Any]:
    """The arm spec of a set of techniques: their overrides in order. A technique may replace what a
    technique it requires set; any other disagreement is an OverrideConflict."""
    spec: dict[str, Any] = {}
    set_by: dict[tuple[str, ...], str] = {}      # (slot,) or (model, field) -> the technique that set it
    for name in cfg.ordered(techniques):
        allowed = cfg.requirements(name)
        for key, value in cfg.technique(name).overrides.items():
            targets = ([((key, f), v) for f, v in value.items()] if key in (MODEL_KEY, ENGINE_KEY) else [((key,), value)])
            for target, new in targets:
                old, owner = _get(spec, target), set_by.get(target)
                if owner is not None and owner not in allowed and _normal(old) != _normal(new):
                    raise OverrideConflict(f"{'.'.join(target)}: {owner} sets {_shown(old)} and {name} sets "
                                           f"{_shown(new)}, and neither requires the other")
                _put(spec, target, new)
                set_by[target] = name
    return spec


def _get(spec: dict[str, Any], target: tuple[str, ...]) -> Any:
    return spec.get(target[0]) if len(target) == 1 else spec.get(target[0], {}).get(target[1])


def _put(spec: dict[str, Any], target: tuple[str, ...], value: Any) -> None:
    if len(target) == 1:
        spec[target[0]] = value
    else:
        spec.setdefault(target[0], {})[target[1]] = value


def _normal(choice: Any) -> Any:
    """`paged` and {name: paged} choose the same plugin."""
    return {"name": choice} if isinstance(choice, str) else choice


def _shown(choice: Any) -> str:
    return choice["name"] if isinstance(choice, dict) and list(choice) == ["name"] else str(choice)


@dataclass
class PlannedArm:
    name: str
    techniques: frozenset[str]
    roles: list[str] = field(default_factory=list)   # baseline, full, add-one-in t, leave-one-out t, reference
    skipped: str = ""                                # why it is not measured ("" when it is)


def plan(cfg: AblationConfig) -> list[PlannedArm]:
    """Every arm the contributions need, one per distinct set of techniques, baseline first."""
    everything = frozenset(cfg.names)
    wanted: list[tuple[str, frozenset[str], str]] = [(BASELINE_ARM, frozenset(), "baseline"),
                                                     (FULL_ARM, everything, "full")]
    wanted += [(f"+{t}", cfg.closure({t}), f"add-one-in {t}") for t in cfg.names]
    wanted += [(f"-{t}", everything - cfg.unit(t), f"leave-one-out {t}") for t in cfg.names]
    for t in cfg.names:    # what add-one-in divides by, and the add-one-in of t's unit the interaction needs
        unit = cfg.closure(cfg.unit(t))
        for techniques in (cfg.requirements(t), unit, unit - cfg.unit(t)):
            wanted.append((set_name(cfg, techniques), techniques, "reference"))
    if cfg.pairs:
        for a, b in itertools.combinations(cfg.names, 2):
            pa, pb = cfg.closure({a}), cfg.closure({b})
            if not (pa <= pb or pb <= pa):
                wanted += [(set_name(cfg, pa | pb), pa | pb, f"pair {a} x {b}"),
                           (set_name(cfg, pa & pb), pa & pb, "reference")]
    arms: dict[frozenset[str], PlannedArm] = {}
    for name, techniques, role in wanted:
        arm = arms.setdefault(techniques, PlannedArm(name, techniques))
        if role not in arm.roles:
            arm.roles.append(role)
    for arm in arms.values():     # "reference" only for an arm that has no other role
        arm.roles = [r for r in arm.roles if r != "reference"] or ["reference"]
    return list(arms.values())


def set_name(cfg: AblationConfig, techniques: frozenset[str]) -> str:
    return "+".join(["", *cfg.ordered(techniques)]) if techniques else BASELINE_ARM
