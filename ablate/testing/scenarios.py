"""What the conformance kit runs a plugin in: a ragged workload under contention, in arms that pair
the plugin with the partners that exercise it (admission, preemption, chunked prefill, rollback).

Contention: more requests than engine slots (max_num_seqs), and for a cache that takes a budget
less KV memory than the workload needs at once, under a scheduler that preempts, so admission,
preemption and release are all exercised.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ablate.api.context import EngineConfig
from ablate.api.kv import KVBudgetConfig
from ablate.api.plugin import Plugin, PluginError, Slot
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import BASELINE, BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry
from ablate.model.llama import LlamaModel


class ConformanceError(AssertionError):
    """A plugin fails the kit: the message names it (`<slot>=<name>`) and the rule it breaks."""


# (prompt, output) lengths: prompts and outputs end at different steps
RAGGED = [(3, 5), (9, 11), (17, 8), (6, 1), (12, 6), (5, 9)]
MAX_NUM_SEQS = 3                # fewer slots than requests
BUDGET_SEQS = 2.5               # a budgeted cache holds the K/V of about this many of the longest sequences


def ragged_requests(vocab_size: int, seed: int = 0, lengths: list[tuple[int, int]] = RAGGED,
                    temperature: float = 0.0) -> list[Request]:
    """Prompts that repeat a short motif (so lookup drafters find matches) with seeded noise; greedy,
    or sampled at `temperature` with a seed per request."""
    rng = random.Random(seed)
    requests = []
    for i, (p, n) in enumerate(lengths):
        motif = [rng.randrange(vocab_size) for _ in range(3)]
        prompt = tuple(motif[j % 3] if rng.random() < 0.7 else rng.randrange(vocab_size) for j in range(p))
        sampling = SamplingParams(temperature, seed=1000 + i) if temperature else SamplingParams()
        requests.append(Request(i, prompt, n, sampling))
    return requests


def max_len(requests: list[Request]) -> int:
    return max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)


@dataclass
class Scenario:
    """An arm spec around the plugin, and the engine limits it runs under."""

    name: str
    spec: dict[str, Any]
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_seqs=MAX_NUM_SEQS))


def arm_spec(registry: Registry, slot: Slot, name: str, partners: dict[Slot, Any] | None = None) -> dict[str, Any]:
    """The baseline with `slot` replaced by the plugin, `partners` in other slots, and whatever the
    plugin requires satisfied (a partner it refuses is replaced by one it accepts)."""
    cls = registry.get(slot, name)
    spec: dict[str, Any] = {s.value: choice for s, choice in (partners or {}).items() if s is not slot}
    spec[slot.value] = name
    for need in cls.requires:
        chosen = spec.get(need.slot.value, BASELINE[need.slot])
        chosen = chosen["name"] if isinstance(chosen, dict) else chosen
        if chosen not in need.names:
            available = sorted(n for n in need.names if n in registry.choices(need.slot))
            if not available:
                raise ConformanceError(f"{slot.value}={name} requires {need.slot.value} in {sorted(need.names)}, "
                                       "none of which is installed")
            spec[need.slot.value] = available[0]
    return spec


def budgeted(registry: Registry, spec: dict[str, Any], model: LlamaModel, requests: list[Request]) -> dict[str, Any]:
    """The spec with a tight budget on its cache, when the cache takes one (KVBudgetConfig)."""
    choice = spec.get(Slot.KV_CACHE.value, BASELINE[Slot.KV_CACHE])
    cache = choice["name"] if isinstance(choice, dict) else choice
    if not issubclass(registry.get(Slot.KV_CACHE, cache).config_class, KVBudgetConfig):
        return spec
    budget = int(BUDGET_SEQS * max_len(requests) * model.config.kv_bytes_per_token())
    options = dict(choice) if isinstance(choice, dict) else {"name": cache}
    return {**spec, Slot.KV_CACHE.value: {**options, "budget_bytes": budget}}


def scenarios(registry: Registry, slot: Slot, name: str, model: LlamaModel, requests: list[Request]) -> list[Scenario]:
    """The plugin alone over the baselines; with a scheduler that preempts over a budgeted cache; with
    speculative decoding (multi-token verification, rollback) on top. Partners that are not
    installed are left out; so is a combination the plugin refuses."""
    installed = {s: set(registry.choices(s)) for s in Slot}
    out = [Scenario("alone", arm_spec(registry, slot, name))]
    partners: dict[Slot, Any] = {}
    if "continuous" in installed[Slot.SCHEDULER] and slot is not Slot.SCHEDULER:
        partners[Slot.SCHEDULER] = {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 8}
    if "paged" in installed[Slot.KV_CACHE] and slot is not Slot.KV_CACHE:
        partners[Slot.KV_CACHE] = {"name": "paged", "block_size": 4}
    if partners:
        out.append(Scenario("preempting", budgeted(registry, arm_spec(registry, slot, name, partners), model, requests)))
    if "speculative" in installed[Slot.DECODING] and slot is not Slot.DECODING:
        speculating = {**partners, Slot.DECODING: {"name": "speculative", "k": 3, "drafter": "ngram", "ngram_min": 1}}
        out.append(Scenario("speculating", budgeted(registry, arm_spec(registry, slot, name, speculating), model,
                                                    requests)))
    runnable = []
    for scenario in out:
        try:
            resolve_arm(scenario.name, scenario.spec, baseline_configs(registry), registry)
        except ValueError:
            continue          # e.g. the plugin requires what a partner replaces
        runnable.append(scenario)
    return runnable


def build(registry: Registry, spec: dict[str, Any], model: LlamaModel, engine: EngineConfig, max_seq_len: int,
          hooks_for=lambda kv_cache: ()) -> BuiltArm:
    arm = resolve_arm("conformance", spec, baseline_configs(registry), registry)
    return build_arm(arm, model, engine, max_seq_len, registry, hooks_for)


def failing(plugin: Plugin | str, scenario: str, err: Exception) -> ConformanceError:
    where = f"in the scenario '{scenario}'"
    if isinstance(err, PluginError):
        return ConformanceError(f"{plugin} fails the kit {where}: {err}")
    return ConformanceError(f"{plugin} fails the kit {where}: {type(err).__name__}: {err}")
