"""Which arms a job measures: the experiment's arms, an ablation's, or the baseline against the
composed plugins. Built once from the typed config; incompatible plugins are refused here, before
any model loads."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ablate.engine.arm import BASELINE, Arm, baseline_configs
from ablate.engine.registry import Registry
from ablate.experiment.ablation import arm_table, plan_arms
from ablate.experiment.config import RunConfig
from ablate.outside.arms import resolve_arm


@dataclass
class Plan:
    arms: list[Arm]
    ablation_arms: pd.DataFrame | None = None    # an ablation: every planned arm, measured or skipped with why


def make_plan(cfg: RunConfig, registry: Registry) -> Plan:
    plugins = cfg.plugins
    if cfg.experiment.ablation is not None:      # techniques -> arms; skipped ones are not arms
        arms, planned = plan_arms(cfg.experiment.ablation, plugins, registry)
        return Plan(arms, arm_table(planned, arms))
    if cfg.experiment.arms:
        return Plan([resolve_arm(name, spec, plugins, registry) for name, spec in cfg.experiment.arms.items()])
    baseline = resolve_arm("baseline", None, baseline_configs(registry), registry)
    if all(c.name == BASELINE[s] for s, c in plugins.items()):
        return Plan([baseline])
    composed = resolve_arm("variant", None, plugins, registry)
    composed.name = composed.label().replace(" ", ",")
    return Plan([baseline, composed])
