"""An ablation's arms: its plan (ablate.analysis.ablation_plan: techniques -> sets of techniques ->
arm specs) resolved against the registry, each arm measured or skipped with the reason, and the table
of them (arm_table) the job stores for the report (ablation_plan.ARMS_TABLE)."""
from __future__ import annotations

import pandas as pd

from ablate.analysis.ablation_plan import AblationConfig, OverrideConflict, PlannedArm, arm_spec, plan
from ablate.api.plugin import PluginConfig, Slot
from ablate.engine.arm import BASELINE, Arm, IncompatiblePlugins
from ablate.engine.registry import Registry
from ablate.outside.arms import resolve_arm


def plan_arms(cfg: AblationConfig, plugins: dict[Slot, PluginConfig], registry: Registry
              ) -> tuple[list[Arm], list[PlannedArm]]:
    """The arms to measure over the composed slots, and the whole plan (skipped arms with their reason).

    The composition must be the core baselines (their options may differ): what a slot holds in
    every arm is not ablated, so a technique has to set it instead.
    """
    fixed = [f"{s.value}={c.name}" for s, c in plugins.items() if c.name != BASELINE[s]]
    if fixed:
        raise ValueError(f"an ablation measures against the core baselines, but {' '.join(fixed)} is composed "
                         "into every arm; turn it on through a technique in experiment.ablation.techniques")
    arms, planned = [], plan(cfg)
    for p in planned:
        try:
            arms.append(resolve_arm(p.name, arm_spec(cfg, p.techniques), plugins, registry))
        except (OverrideConflict, IncompatiblePlugins) as err:
            p.skipped = str(err)
    return arms, planned


def arm_table(planned: list[PlannedArm], arms: list[Arm]) -> pd.DataFrame:
    """One row per planned arm: its techniques, roles, plugins, and measured or skipped with why."""
    labels = {a.name: a.label() for a in arms}
    return pd.DataFrame([{"arm": p.name, "techniques": "+".join(sorted(p.techniques)), "roles": "; ".join(p.roles),
                          "label": labels.get(p.name, ""), "status": "skipped" if p.skipped else "measured",
                          "reason": p.skipped} for p in planned])
