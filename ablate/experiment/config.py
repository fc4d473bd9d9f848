"""The whole run's config as typed dataclasses, built once from the composed dict.

Hydra composes YAML and the plugins' config dataclasses into a plain dict; `to_run_config` turns
it into a RunConfig, validating every field (each dataclass's __post_init__): the plugins of each
slot, the experiment with its arms (ArmSpec) and ablation (AblationConfig) parsed, the workload,
the engine, W&B and the cost calculator. Nothing downstream parses the dict again; the raw dict is
kept only to hash the results folder and to store as config.json.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ablate.analysis.costs import CostsConfig
from ablate.book.config import BookConfig
from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginConfig, Slot
from ablate.engine.arm import ArmSpec
from ablate.engine.registry import Registry
from ablate.analysis.ablation_plan import AblationConfig, parse_ablation
from ablate.field_types import check_field_types
from ablate.experiment.job_size import check_prompt_fits, check_run_size
from ablate.experiment.quality_guard import QualityConfig
from ablate.model.config import ModelConfig
from ablate.model.product_paths import SETTINGS as CPU_PRODUCTS
from ablate.report.wandb_log import WandbConfig
from ablate.workload.requests import WorkloadConfig


KINDS = ("engine", "costs", "book")


@dataclass
class ExperimentConfig:
    name: str = "default"
    chapter: str = ""                     # e.g. ch08: tags the W&B run
    # name -> {slot: plugin | {name, options}, model: {field: value}}; ArmSpec once built
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    baseline: str = ""                    # the arm speedups are relative to; "" -> the first
    repeats: int = 5                      # rounds (every arm once each); a CI needs >= 3 (ablate/analysis/stats.py)
    max_repeats: int = 0                  # > repeats: more rounds until every speedup CI is within ci_target
    ci_target: float = 0.05               # relative half-width of the speedup CI that ends the extra rounds
    time_budget_s: float = 0.0            # > 0: no extra round starts once the job has run this long
    warmup: int = 1                       # warm-up runs per arm of the whole workload (excluded)
    grid: dict[str, list] = field(default_factory=dict)  # workload field -> values, one point each
    recorder: bool = True                 # False: time the runs with no hooks at all
    ttft_slo_ms: float | None = None      # goodput: requests meeting every SLO given
    tpot_slo_ms: float | None = None
    # a sweep over workload.rate with ttft_slo_ms: the knee is the highest rate whose TTFT-SLO
    # attainment (median over rounds) stays >= this fraction (ablate/analysis/knee.py)
    knee_target: float = 0.9
    # CPU: count tensor bytes during each run (ablate.measure.memory), so that peak memory includes
    # activations and attention's scores, not only weights + KV; every op then runs slower
    track_memory: bool = False
    kind: str = "engine"                  # engine: arms through the engine; costs: the cost calculator only
                                          # (ablate/analysis/costs.py; no model is loaded, arms and grid are unused);
                                          # book: the chapter's claims table (ablate/book)
    # techniques -> arms instead of `arms` (ablate/experiment/ablation.py): full, baseline, leave-one-out, add-one-in
    ablation: AblationConfig | None = None
    # the quality guardrail: token agreement and perplexity ratio against the baseline, per arm
    quality: QualityConfig = field(default_factory=QualityConfig)

    def __post_init__(self) -> None:
        if isinstance(self.quality, dict):
            self.quality = build(QualityConfig, self.quality, "experiment.quality")
        self.arms = {name: spec if isinstance(spec, ArmSpec) else ArmSpec.parse(f"experiment.arms.{name}", spec)
                     for name, spec in (self.arms or {}).items()}
        if isinstance(self.ablation, dict):
            self.ablation = parse_ablation(self.ablation) if self.ablation else None
        if self.kind not in KINDS:
            raise ValueError(f"experiment.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.repeats < 1:
            raise ValueError(f"experiment.repeats must be >= 1, got {self.repeats}")
        if self.max_repeats and self.max_repeats < self.repeats:
            raise ValueError(f"experiment.max_repeats={self.max_repeats} is below experiment.repeats={self.repeats}: "
                             "set it above repeats for extra rounds, or to 0 for exactly `repeats` rounds")
        if not (math.isfinite(self.ci_target) and self.ci_target > 0):
            raise ValueError(f"experiment.ci_target must be a positive fraction (0.05: +-5%), got {self.ci_target}")
        if not (math.isfinite(self.time_budget_s) and self.time_budget_s >= 0):
            raise ValueError(f"experiment.time_budget_s must be >= 0 seconds (0: no budget), got {self.time_budget_s}")
        if self.warmup < 0:
            raise ValueError(f"experiment.warmup must be >= 0, got {self.warmup}")
        for slo in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, slo)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"experiment.{slo} must be a positive number of milliseconds, got {value}")
        if isinstance(self.knee_target, bool) or not (isinstance(self.knee_target, (int, float))
                                                      and 0 < self.knee_target <= 1):   # NaN fails too
            raise ValueError(f"experiment.knee_target must be a fraction in (0, 1] (0.9: 90% of requests meet the "
                             f"TTFT SLO), got {self.knee_target!r}")
        for key, values in self.grid.items():
            if key not in WorkloadConfig.__dataclass_fields__:
                raise ValueError(f"experiment.grid: {key!r} is not a workload field; fields are "
                                 f"{', '.join(WorkloadConfig.__dataclass_fields__)}")
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"experiment.grid.{key} must be a non-empty list of values")
            repeated = [v for i, v in enumerate(values) if v in values[:i]]
            if repeated:      # one point measured twice would be pooled into one row with twice the rounds
                raise ValueError(f"experiment.grid.{key} lists {', '.join(map(str, repeated))} more than once "
                                 f"({values}): each value is one grid point; give each once")
        if self.ablation is not None:
            if self.arms:
                raise ValueError("experiment.arms and experiment.ablation are both set: an ablation makes its own arms")
            if self.grid:   # contributions compare arms on one workload
                raise ValueError("experiment.ablation measures one workload: leave experiment.grid empty "
                                 "(or sweep workload fields with -m)")
            if not self.recorder or self.kind != "engine":
                raise ValueError("experiment.ablation needs experiment.recorder=true and kind=engine: its "
                                 "contributions are latency percentiles and KV bytes the recorder measures")


@dataclass
class RunConfig:
    plugins: dict[Slot, PluginConfig]     # one plugin config per slot (`kv_cache=contiguous`)
    model: ModelConfig = field(default_factory=ModelConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    costs: CostsConfig | None = None      # experiment.kind=costs: the cost calculator's options
    book: BookConfig | None = None        # experiment.kind=book: the claims table's options
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    threads: int = 0              # torch CPU threads; 0: torch's default
    # the path of every CPU matrix product: auto (each kind timed, the fastest kept) or one forced
    # (ablate/model/product_paths.py); applied at the job's start, recorded in environment.json
    cpu_products: str = "auto"    # auto | mkl | onednn | numpy | native
    peak_bandwidth: float = 0.0   # bytes/s for MBU and the roofline; 0: measured on this machine
    peak_flops: float = 0.0       # FLOP/s; 0: measured
    results_dir: str = "results"
    redo: bool = False            # re-run a config whose results already exist

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        if self.cpu_products not in CPU_PRODUCTS:
            raise ValueError(f"cpu_products must be one of {', '.join(CPU_PRODUCTS)}, got {self.cpu_products!r}")
        for name in ("peak_bandwidth", "peak_flops"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0 (0: measured on this machine), got {value}")
        if self.experiment.kind == "engine":
            check_run_size(self.workload, self.experiment.grid)
            check_prompt_fits(self.workload, self.experiment.grid, self.engine.max_seq_len)


def build(cls: type, values: dict[str, Any] | None, where: str):
    """A dataclass from a dict, with an error that names the bad key and the valid ones."""
    values = dict(values or {})
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"{where} has no field {', '.join(unknown)}; valid fields: {', '.join(valid)}")
    prefix = "" if where == "config" else f"{where}."       # the top level's options are bare: threads=4
    try:
        built = cls(**values)
    except TypeError as err:            # e.g. `threads=abc` compared with 0: name the option instead
        check_field_types(cls, values, prefix)
        raise ValueError(f"{where}: {err}") from err
    check_field_types(cls, values, prefix)     # built, yet of the wrong kind: `redo=no` would be true
    return built


SECTIONS = ("model", "experiment", "workload", "engine", "wandb", "costs", "book")
TOP_LEVEL = ("device", "threads", "cpu_products", "peak_bandwidth", "peak_flops", "results_dir", "redo")


def to_run_config(raw: dict[str, Any], registry: Registry) -> RunConfig:
    """The composed config (a plain dict) -> RunConfig, every part validated."""
    known = {slot.value for slot in Slot} | set(SECTIONS) | set(TOP_LEVEL)
    unknown = sorted(set(raw) - known)
    if unknown:    # e.g. +bogus=1: Hydra adds it, nothing would read it
        raise ValueError(f"unknown option {', '.join(unknown)} at the top level of the config; the top level "
                         f"has {', '.join(sorted(known))}")
    plugins = {}
    for slot in Slot:
        node = dict(raw.get(slot.value) or {})
        if "name" not in node:
            raise ValueError(f"no plugin chosen for slot {slot.value}; choose one of {registry.choices(slot)}")
        check_field_types(registry.get(slot, node["name"]).config_class, node, f"{slot.value}.")
        plugins[slot] = registry.config(slot, node["name"], node)
    return build(RunConfig, {
        "plugins": plugins,
        "model": build(ModelConfig, raw.get("model"), "model"),
        "experiment": build(ExperimentConfig, raw.get("experiment"), "experiment"),
        "workload": build(WorkloadConfig, raw.get("workload"), "workload"),
        "engine": build(EngineConfig, raw.get("engine"), "engine"),
        "wandb": build(WandbConfig, raw.get("wandb"), "wandb"),
        "costs": build(CostsConfig, raw.get("costs"), "costs") if raw.get("costs") is not None else None,
        "book": build(BookConfig, raw.get("book"), "book") if raw.get("book") is not None else None,
        **{k: raw[k] for k in TOP_LEVEL if k in raw},
    }, "config")
