"""The kit's checks through whole engine runs, in every scenario (scenarios.py), twice on one built
arm so that room a plugin never gives back shows up as a stall or a leak:

- the engine's own contract checks (ablate.engine.engine): a valid batch every step, emissions only
  of fed drafts, every request finished, every sequence's room released, stats as declared;
- a KV cache's memory accounting at every step (storage.py);
- an exact plugin gives the baseline's greedy tokens (up to ties: ablate.measure.exactness);
- attention never edits the K/V its view hands it (over the kit's cache whose view is its storage);
- the scenario reached the states it exists for (coverage.py): a run that never ran out of room,
  preempted or chunked a prompt has checked nothing of what a plugin does there.
"""
from __future__ import annotations

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sequence import Sequence
from ablate.engine.registry import Registry
from ablate.measure.exactness import compare_greedy
from ablate.model.llama import LlamaModel
from ablate.testing.coverage import Coverage, CoverageHook
from ablate.testing.scenarios import (ConformanceError, Scenario, build, failing, max_len, ragged_requests, scenarios,
                                      with_kit_plugins)
from ablate.testing.storage import StorageCheck
from ablate.testing.storage_view import StorageViewKVCache

NUM_RUNS = 2     # per built arm: the second one starts from whatever the first left behind


def baseline_outputs(registry: Registry, model: LlamaModel, requests) -> list[Sequence]:
    built = build(registry, {}, model, EngineConfig(max_num_seqs=len(requests)), max_len(requests))
    try:
        return built.engine.run(requests)
    finally:
        built.close()


def check_runs(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> dict[str, Coverage]:
    """Run every scenario; returns what each one reached, by name."""
    plugin = f"{slot.value}={name}"
    registry = with_kit_plugins(registry)
    requests = ragged_requests(model.config.vocab_size)
    want = baseline_outputs(registry, model, requests)
    exact = registry.get(slot, name).exact
    ran: dict[str, Coverage] = {}
    for scenario in scenarios(registry, slot, name, model, requests):
        hooks: list = []

        def hooks_for(kv_cache, hooks=hooks, budget=scenario.budget_bytes):
            hooks[:] = [StorageCheck(kv_cache), CoverageHook(kv_cache, budget)]
            return hooks

        try:
            built = build(registry, scenario.spec, model, scenario.engine, max_len(requests), hooks_for)
        except (PluginError, ValueError) as err:
            raise failing(plugin, scenario.name, err) from err
        storage, coverage = hooks[0], hooks[1].coverage
        try:
            for run in range(NUM_RUNS):
                try:
                    got = built.engine.run(requests)
                    built.stats()
                except Exception as err:   # a plugin's failure, with the engine's diagnosis when it has one
                    raise failing(plugin, f"{scenario.name}, run {run + 1}", err) from err
                coverage.add_finished(got)
                if storage.problems:
                    raise ConformanceError(f"{built.kv_cache} misreports its memory in the '{scenario.name}' scenario "
                                           f"(testing {plugin}): {storage.problems[0]}")
                if isinstance(built.kv_cache, StorageViewKVCache) and built.kv_cache.edited:
                    raise ConformanceError(f"{plugin} edits the K/V its view hands it in the '{scenario.name}' scenario "
                                           f"(a cache whose view is its storage): {built.kv_cache.edited}; attention "
                                           "must only read it")
                if exact and _all_partners_exact(registry, scenario):
                    agreement = compare_greedy(model, want, got)
                    if not agreement.matches:
                        raise ConformanceError(
                            f"{plugin} is declared exact but in the '{scenario.name}' scenario {agreement.num_diverged} "
                            f"of {agreement.num_compared} requests differ from the baseline's greedy tokens; first: "
                            f"{agreement.first_divergence}")
        finally:
            built.close()
        if missing := coverage.missing(scenario.expects):
            partners = ", ".join(f"{k}={v['name'] if isinstance(v, dict) else v}" for k, v in scenario.spec.items())
            raise ConformanceError(
                f"{plugin} never reached what the '{scenario.name}' scenario ({partners}) exists to check: "
                f"{'; '.join(missing)}. The kit cannot tell whether it handles that: a plugin must let every "
                "scenario reach its states")
        ran[scenario.name] = coverage
    return ran


def _all_partners_exact(registry: Registry, scenario: Scenario) -> bool:
    for slot_name, choice in scenario.spec.items():
        plugin_name = choice["name"] if isinstance(choice, dict) else choice
        if not registry.get(Slot(slot_name), plugin_name).exact:
            return False
    return True
