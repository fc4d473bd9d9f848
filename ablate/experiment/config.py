"""The whole run's config as plain dataclasses: the Hydra schema, and what the engine receives.

Hydra composes YAML and the plugins' config dataclasses into this shape; `to_run_config` turns the
composed dict back into dataclasses, which validates every field (in `__post_init__`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ablate.api.context import EngineConfig
from ablate.experiment.run import ExperimentConfig
from ablate.model.config import ModelConfig
from ablate.api.plugin import PluginConfig, Slot
from ablate.engine.registry import Registry
from ablate.report.wandb_log import WandbConfig
from ablate.workload.requests import WorkloadConfig


@dataclass
class RunConfig:
    model: Any = None             # a ModelConfig preset (`model=smollm2-135m`)
    variant: Any = None           # one plugin config per slot (`kv_cache=contiguous`)
    kv_cache: Any = None
    attention: Any = None
    scheduler: Any = None
    decoding: Any = None
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    threads: int = 0              # torch CPU threads; 0: torch's default
    peak_bandwidth: float = 0.0   # bytes/s for MBU and the roofline; 0: measured on this machine
    peak_flops: float = 0.0       # FLOP/s; 0: measured
    results_dir: str = "results"
    redo: bool = False            # re-run a config whose results already exist


def build(cls: type, values: dict[str, Any] | None, where: str):
    """A dataclass from a dict, with an error that names the bad key and the valid ones."""
    values = dict(values or {})
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"{where} has no field {', '.join(unknown)}; valid fields: {', '.join(valid)}")
    try:
        return cls(**values)
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from err


def to_run_config(raw: dict[str, Any], registry: Registry) -> tuple[RunConfig, dict[Slot, PluginConfig]]:
    """The composed config (a plain dict) -> RunConfig with dataclass members, and the slots' plugins."""
    plugins = {}
    for slot in Slot:
        node = dict(raw.get(slot.value) or {})
        if "name" not in node:
            raise ValueError(f"no plugin chosen for slot {slot.value}; choose one of {registry.choices(slot)}")
        plugins[slot] = registry.config(slot, node["name"], node)
    cfg = RunConfig(
        model=build(ModelConfig, raw.get("model"), "model"),
        experiment=build(ExperimentConfig, raw.get("experiment"), "experiment"),
        workload=build(WorkloadConfig, raw.get("workload"), "workload"),
        engine=build(EngineConfig, raw.get("engine"), "engine"),
        wandb=build(WandbConfig, raw.get("wandb"), "wandb"),
        **{k: raw[k] for k in ("device", "threads", "peak_bandwidth", "peak_flops", "results_dir", "redo")
           if k in raw},
        **{slot.value: plugins[slot] for slot in Slot},
    )
    return cfg, plugins
