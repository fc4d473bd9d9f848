"""The conformance kit: checks any plugin, built-in or third-party, against the engine's contract.

    from ablate.testing import check_plugin
    check_plugin("kv_cache", "my_cache")     # raises ConformanceError naming the plugin and the rule

What it checks, on the tiny model, in order (each module's docstring has the details):
  declarations.py   the config round-trips through Hydra; requirements are enforced; stats and figures
                    are well formed; a plugin that is not exact declares a quality bound
  run_checks.py     whole engine runs under contention (scenarios.py: fewer slots and less KV memory
                    than the workload needs, a preempting scheduler, speculative rollback), each twice on
                    one built arm: the engine's contract checks, the cache's memory accounting, an exact
                    plugin's greedy tokens against the baseline's, its stats as declared
  runner_checks.py  teacher forcing: batch invariance (a sequence sees only its own K/V) and, for exact
                    plugins, logits equal to the baseline's at every position
  sampling.py       a decoding plugin samples from the target's exact distribution (a statistical test)
  quality.py        a plugin that is not exact stays within its declared perplexity bound
"""
from __future__ import annotations

from ablate.api.plugin import Slot
from ablate.engine.registry import Registry, default_registry
from ablate.model.config import preset
from ablate.model.llama import LlamaModel
from ablate.testing.declarations import check_config_roundtrip, check_declarations, check_requirements_enforced
from ablate.testing.quality import check_quality
from ablate.testing.run_checks import check_runs
from ablate.testing.runner_checks import check_runner
from ablate.testing.sampling import check_sampling


def check_plugin(slot: Slot | str, name: str, registry: Registry | None = None,
                 model: LlamaModel | None = None) -> None:
    """Every check of the kit; raises ConformanceError (an AssertionError) at the first failure."""
    slot = Slot(slot)
    registry = registry or default_registry()
    model = model or LlamaModel.random(preset("tiny"))
    check_declarations(registry, slot, name)
    check_config_roundtrip(registry, slot, name)
    check_requirements_enforced(registry, slot, name)
    check_runs(registry, slot, name, model)
    check_runner(registry, slot, name, model)
    check_sampling(registry, slot, name, model)
    check_quality(registry, slot, name, model)
