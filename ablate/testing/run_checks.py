"""The kit's checks through whole engine runs, in every scenario (scenarios.py), twice on one built
arm so that room a plugin never gives back shows up as a stall or a leak:

- the engine's own contract checks (ablate.engine.engine): a valid batch every step, emissions only
  of fed drafts, every request finished, every sequence's room released, stats as declared;
- a KV cache's memory accounting at every step (storage.py);
- an exact plugin gives the baseline's greedy tokens (up to ties: ablate.measure.exactness).
"""
from __future__ import annotations

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sequence import Sequence
from ablate.engine.registry import Registry
from ablate.measure.exactness import compare_greedy
from ablate.model.llama import LlamaModel
from ablate.testing.scenarios import ConformanceError, Scenario, build, failing, max_len, ragged_requests, scenarios
from ablate.testing.storage import StorageCheck

NUM_RUNS = 2     # per built arm: the second one starts from whatever the first left behind


def baseline_outputs(registry: Registry, model: LlamaModel, requests) -> list[Sequence]:
    built = build(registry, {}, model, EngineConfig(max_num_seqs=len(requests)), max_len(requests))
    try:
        return built.engine.run(requests)
    finally:
        built.close()


def check_runs(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> list[str]:
    """Run every scenario; returns their names."""
    plugin = f"{slot.value}={name}"
    requests = ragged_requests(model.config.vocab_size)
    want = baseline_outputs(registry, model, requests)
    exact = registry.get(slot, name).exact
    ran = []
    for scenario in scenarios(registry, slot, name, model, requests):
        storage: list[StorageCheck] = []

        def hooks(kv_cache, storage=storage):
            storage.append(StorageCheck(kv_cache))
            return storage

        try:
            built = build(registry, scenario.spec, model, scenario.engine, max_len(requests), hooks)
        except (PluginError, ValueError) as err:
            raise failing(plugin, scenario.name, err) from err
        try:
            for run in range(NUM_RUNS):
                try:
                    got = built.engine.run(requests)
                    built.stats()
                except Exception as err:   # a plugin's failure, with the engine's diagnosis when it has one
                    raise failing(plugin, f"{scenario.name}, run {run + 1}", err) from err
                if storage[0].problems:
                    raise ConformanceError(f"{built.kv_cache} misreports its memory in the '{scenario.name}' scenario "
                                           f"(testing {plugin}): {storage[0].problems[0]}")
                if exact and _all_partners_exact(registry, scenario):
                    agreement = compare_greedy(model, want, got)
                    if not agreement.matches:
                        raise ConformanceError(
                            f"{plugin} is declared exact but in the '{scenario.name}' scenario {agreement.num_diverged} "
                            f"of {agreement.num_compared} requests differ from the baseline's greedy tokens; first: "
                            f"{agreement.first_divergence}")
            ran.append(scenario.name)
        finally:
            built.close()
    return ran


def _all_partners_exact(registry: Registry, scenario: Scenario) -> bool:
    for slot_name, choice in scenario.spec.items():
        plugin_name = choice["name"] if isinstance(choice, dict) else choice
        if not registry.get(Slot(slot_name), plugin_name).exact:
            return False
    return True
