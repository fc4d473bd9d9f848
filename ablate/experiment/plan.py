"""Which arms a job measures: the experiment's arms, an ablation's, or the baseline against the
composed plugins. Built once from the typed config; incompatible plugins, and model variants that
cannot convert the model's shape, are refused here, before any model loads."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd

from ablate.api.plugin import Slot
from ablate.checkpoints.loader import checkpoint_shape
from ablate.engine.arm import BASELINE, Arm, IncompatiblePlugins, baseline_configs
from ablate.engine.registry import Registry
from ablate.experiment.ablation import arm_table, plan_arms
from ablate.experiment.config import RunConfig
from ablate.model.config import ModelConfig
from ablate.outside.arms import resolve_arm


@dataclass
class Plan:
    arms: list[Arm]
    ablation_arms: pd.DataFrame | None = None    # an ablation: every planned arm, measured or skipped with why


def make_plan(cfg: RunConfig, registry: Registry) -> Plan:
    plan = _arms(cfg, registry)
    refuse_variants(plan.arms, cfg.model, registry)
    refuse_attention(plan.arms, cfg.model, registry)
    return plan


def _arms(cfg: RunConfig, registry: Registry) -> Plan:
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


def refuse_variants(arms: list[Arm], model: ModelConfig, registry: Registry) -> None:
    """An arm whose model variant cannot convert the model (ModelVariant.refusal, on its shape: the
    preset's or the checkpoint's config.json, no weights read) is refused here, naming the arm and
    why, before anything loads."""
    for arm in arms:
        variant = arm.plugins.get(Slot.MODEL)
        if arm.outside is not None or variant is None or variant.name == BASELINE[Slot.MODEL]:
            continue
        try:
            shape = checkpoint_shape(replace(model, **arm.model_overrides))
        except (OSError, ValueError):      # a checkpoint it cannot read: the loader says so, naming the file
            continue
        why = registry.get(Slot.MODEL, variant.name).refusal(variant, shape)
        if why:
            raise IncompatiblePlugins(f"arm {arm.name!r}: {why}")


def refuse_attention(arms: list[Arm], model: ModelConfig, registry: Registry) -> None:
    """An arm whose attention plugin lacks a feature the model's layers need (a sliding window,
    soft-capped scores: Attention.missing_features, on the preset's or the checkpoint's config.json)
    is refused here, naming the arm, the plugin, the feature and the layers, before anything loads
    (build_arm checks the model it is given again)."""
    for arm in arms:
        if arm.outside is not None:
            continue
        try:
            shape = checkpoint_shape(replace(model, **arm.model_overrides))
        except (OSError, ValueError):      # a checkpoint it cannot read: the loader says so, naming the file
            continue
        attention = registry.get(Slot.ATTENTION, arm.plugins[Slot.ATTENTION].name)
        why = attention.missing_features([shape.layer_attention(i) for i in range(shape.n_layers)])
        if why:
            raise IncompatiblePlugins(f"arm {arm.name!r}: model {shape.name!r}: {why}")
