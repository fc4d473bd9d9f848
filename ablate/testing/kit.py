"""The conformance kit: checks any plugin, built-in or third-party, against the engine's contract.

    from ablate.testing import check_plugin
    check_plugin("kv_cache", "my_cache")     # raises ConformanceError naming the plugin and the rule

What it checks, on the tiny model, in order (each module's docstring has the details):
  declarations.py   the config round-trips through Hydra; requirements are enforced; stats and figures
                    are well formed; a plugin that is not exact declares a quality bound
  run_checks.py     whole engine runs under contention (scenarios.py: fewer slots and less KV memory
                    than the workload needs, a preempting scheduler, chunked prefill, speculative
                    rollback, a cache whose view is its storage), each twice on one built arm: the
                    engine's contract checks, the cache's memory accounting, an exact plugin's greedy
                    tokens against the baseline's, its stats as declared, and that each scenario reached
                    the states it exists for (coverage.py: admissions refused, preemptions, ...)
  runner_checks.py  teacher forcing: batch invariance (a sequence sees only its own K/V) and, for exact
                    plugins, logits equal to the baseline's at every position
  slot_places.py    a cache that gives a decode step's places (KVCache.paged_slots) names the rows
                    write() fills and view()'s own pools and tables, at every layer of every step
  sampling.py       a decoding plugin samples from the target's exact distribution (a statistical test)
                    at several temperatures and top_p, greedy requests beside sampled ones
  quality.py        a plugin that is not exact stays within its declared perplexity bound
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ablate.api.plugin import Slot
from ablate.engine.registry import Registry, default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.testing.coverage import Coverage
from ablate.testing.declarations import check_config_roundtrip, check_declarations, check_requirements_enforced
from ablate.testing.quality import check_quality
from ablate.testing.run_checks import check_runs
from ablate.testing.runner_checks import check_runner
from ablate.testing.sampling import check_sampling
from ablate.testing.slot_places import check_paged_slots


@dataclass
class KitReport:
    """What the kit ran and measured on a plugin that passed it."""

    plugin: str
    coverage: dict[str, Coverage]                      # engine runs under contention: what each reached
    runner_models: list[str]                           # teacher-forcing checks
    paged_slot_writes: int = 0                         # a cache giving paged_slots: layer writes checked
    sampling: tuple[float, float, int] | None = None   # decoding: (largest |z|, smallest KS p, tokens)
    sampling_coverage: Coverage | None = field(default=None, repr=False)   # decoding: the sampled run
    perplexity: tuple[float, float] | None = None      # not exact: (baseline's, the plugin's)
    bound: float | None = None

    @property
    def scenarios(self) -> list[str]:
        return list(self.coverage)

    def __str__(self) -> str:
        lines = [f"{self.plugin} passes the conformance kit",
                 f"  engine runs under contention: {', '.join(self.scenarios)}"]
        for name, c in self.coverage.items():
            lines.append(f"    {name}: {c.admissions_refused} admissions and {c.growths_refused} growths refused, "
                         f"{c.preemptions} preemptions, {c.resumed} resumed, {c.chunk_before_emitter} steps with a "
                         "silent chunk before an emitting sequence")
        if self.runner_models:
            lines.append(f"  teacher forcing (batch invariance, logits): {', '.join(self.runner_models)}")
        if self.paged_slot_writes:
            lines.append(f"  paged_slots: the rows and views it gives checked at {self.paged_slot_writes} layer writes "
                         "of decode steps")
        if self.sampling:
            z, p, n = self.sampling
            lines.append(f"  sampling: z = {z:+.2f}, KS p = {p:.2g} (the worst of each temperature and top_p) over "
                         f"{n} tokens")
            if c := self.sampling_coverage:
                lines.append(f"    temperatures {sorted(c.temperatures)}, top_p {sorted(c.top_ps)}, "
                             f"{c.mixed_batches} steps mixing greedy and sampled requests")
        if self.perplexity:
            base, got = self.perplexity
            lines.append(f"  perplexity {got:.3f} vs the baseline's {base:.3f}: ratio {got / base:.4f} "
                         f"(bound {self.bound}; a bound just above the measured ratio catches more bugs)")
        return "\n".join(lines)


def check_plugin(slot: Slot | str, name: str, registry: Registry | None = None,
                 model: LlamaModel | None = None) -> KitReport:
    """Every check of the kit; raises ConformanceError (an AssertionError) at the first failure, or
    returns what it measured."""
    slot = Slot(slot)
    registry = registry or default_registry()
    model = model or LlamaModel.random(preset("tiny"))
    check_declarations(registry, slot, name)
    check_config_roundtrip(registry, slot, name)
    check_requirements_enforced(registry, slot, name)
    report = KitReport(f"{slot.value}={name}", check_runs(registry, slot, name, model),
                       check_runner(registry, slot, name, model))
    report.paged_slot_writes = check_paged_slots(registry, slot, name, model)
    sampled = check_sampling(registry, slot, name, model)
    if sampled is not None:
        report.sampling, report.sampling_coverage = sampled
    report.perplexity = check_quality(registry, slot, name, model)
    quality = registry.get(slot, name).quality
    report.bound = quality.max_ratio if quality else None
    return report
