"""What the conformance kit runs a plugin in: a ragged workload under contention, in arms that pair
the plugin with the partners that exercise it (admission, preemption, chunked prefill, rollback, a
cache whose view is its storage), and the states each arm must reach (coverage.py).

Contention: more requests than engine slots (max_num_seqs), and for a cache that takes a budget
less KV memory than the workload needs at once, in the cache's own bytes per token (a cache that
compresses K/V must run out of room as surely as one that does not), under a scheduler that
preempts, so admission, preemption, resumption and release are all exercised.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ablate.api.context import EngineConfig
from ablate.api.kv import KVBudgetConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import BASELINE, BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry
from ablate.model.llama import LlamaModel
from ablate.testing.failures import ConformanceError, failing
from ablate.testing.storage_view import StorageViewKVCache


# (prompt, output) lengths: prompts and outputs end at different steps. The longest prompt comes first:
# split into chunks it feeds one that emits nothing ahead of the short prompts admitted after it
RAGGED = [(17, 8), (3, 5), (9, 11), (6, 1), (12, 6), (5, 9)]
MAX_NUM_SEQS = 4                # fewer slots than requests
BUDGET_SEQS = 2                 # a budgeted cache holds the K/V of this many of the longest sequences
# the partners that exercise a plugin: a scheduler preempting and splitting prompts, a cache that
# claims blocks as sequences grow (so growth, not only admission, runs out of room)
CHUNKED = {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 8}
GROWING = {"name": "paged", "block_size": 4}
UP_FRONT = {"name": "contiguous"}      # reserves a sequence's whole length when it admits it
SPECULATIVE = {"name": "speculative", "k": 3, "drafter": "ngram", "ngram_min": 1}


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
    """An arm spec around the plugin, the engine limits it runs under, and the states it must reach
    (names of coverage.STATES)."""

    name: str
    spec: dict[str, Any]
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_seqs=MAX_NUM_SEQS))
    expects: tuple[str, ...] = ()
    budget_bytes: int = 0          # the cache's budget, 0: none


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


def chosen(spec: dict[str, Any], slot: Slot) -> str:
    """The name of the plugin `spec` puts in `slot`."""
    choice = spec.get(slot.value, BASELINE[slot])
    return choice["name"] if isinstance(choice, dict) else choice


def cache_bytes_per_token(registry: Registry, spec: dict[str, Any], model: LlamaModel, requests: list[Request]) -> int:
    """What the arm's cache says one token takes in its storage: built once, unbudgeted, to ask it."""
    built = build(registry, spec, model, EngineConfig(max_num_seqs=MAX_NUM_SEQS), max_len(requests))
    try:
        return built.kv_cache.bytes_per_token
    finally:
        built.close()


def budgeted(registry: Registry, spec: dict[str, Any], model: LlamaModel, requests: list[Request]
             ) -> tuple[dict[str, Any], int]:
    """The spec with a tight budget on its cache, in the cache's own bytes per token, when the cache
    takes one (KVBudgetConfig); and that budget (0: none)."""
    cache = chosen(spec, Slot.KV_CACHE)
    if not issubclass(registry.get(Slot.KV_CACHE, cache).config_class, KVBudgetConfig):
        return spec, 0
    per_token = cache_bytes_per_token(registry, spec, model, requests)
    if per_token <= 0:
        raise ConformanceError(
            f"kv_cache={cache} reports bytes_per_token = {per_token}, but it keeps K/V: every token it holds takes "
            "bytes (results, memory figures and budgets in tokens are computed from it)")
    budget = int(BUDGET_SEQS * max_len(requests) * per_token)
    choice = spec.get(Slot.KV_CACHE.value)
    options = dict(choice) if isinstance(choice, dict) else {"name": cache}
    return {**spec, Slot.KV_CACHE.value: {**options, "budget_bytes": budget}}, budget


def states_to_reach(registry: Registry, spec: dict[str, Any], budget: int, preempting: bool) -> tuple[str, ...]:
    """What an arm under contention must go through, given the partners it ended up with: a budgeted
    cache runs out of room; in the `preempting` scenario, a preempting scheduler over a cache that
    claims room as sequences grow preempts and resumes; a cache that reserves up front refuses an
    admission; the kit's chunking scheduler puts a silent prompt chunk ahead of an emitting sequence."""
    states: list[str] = []
    scheduler, cache = chosen(spec, Slot.SCHEDULER), chosen(spec, Slot.KV_CACHE)
    if budget:
        states.append("pressure")
        if preempting and cache == GROWING["name"] and registry.get(Slot.SCHEDULER, scheduler).preempts:
            states += ["preemptions", "resumed"]
        if cache == UP_FRONT["name"]:
            states.append("admissions_refused")
    if spec.get(Slot.SCHEDULER.value) == CHUNKED:
        states.append("chunk_before_emitter")
    return tuple(states)


def with_kit_plugins(registry: Registry) -> Registry:
    """The registry plus the kit's own plugins (the cache whose view is its storage)."""
    if StorageViewKVCache.name in registry.choices(Slot.KV_CACHE):
        return registry
    return registry.with_plugins(StorageViewKVCache)


def scenarios(registry: Registry, slot: Slot, name: str, model: LlamaModel, requests: list[Request]) -> list[Scenario]:
    """The plugin alone over the baselines; under contention with a scheduler that preempts and a
    cache that runs out of room (a scheduler plugin: over a cache it can cope with); with speculative
    decoding (multi-token verification, rollback) on top; an attention plugin over a cache whose view
    is its storage. Partners that are not installed are left out; so is a combination the plugin
    refuses. `registry` must hold the kit's plugins (with_kit_plugins)."""
    installed = {s: set(registry.choices(s)) for s in Slot}
    partners: dict[Slot, Any] = {}
    if slot is Slot.SCHEDULER:
        cache = GROWING if registry.get(slot, name).preempts else UP_FRONT
        if cache["name"] in installed[Slot.KV_CACHE]:
            partners[Slot.KV_CACHE] = cache
    else:
        if CHUNKED["name"] in installed[Slot.SCHEDULER]:
            partners[Slot.SCHEDULER] = CHUNKED
        if GROWING["name"] in installed[Slot.KV_CACHE] and slot is not Slot.KV_CACHE:
            partners[Slot.KV_CACHE] = GROWING
    candidates = [("alone", {}, False)]
    if partners:
        candidates.append(("preempting", partners, True))
    if SPECULATIVE["name"] in installed[Slot.DECODING] and slot is not Slot.DECODING:
        candidates.append(("speculating", {**partners, Slot.DECODING: SPECULATIVE}, True))
    if slot is Slot.ATTENTION:
        candidates.append(("storage-view", {Slot.KV_CACHE: StorageViewKVCache.name}, False))
    out = []
    for label, chosen_partners, contended in candidates:
        spec = arm_spec(registry, slot, name, chosen_partners)
        try:
            resolve_arm(label, spec, baseline_configs(registry), registry)
        except ValueError:
            continue          # e.g. the plugin requires what a partner replaces
        if label == "storage-view" and chosen(spec, Slot.KV_CACHE) != StorageViewKVCache.name:
            continue          # the plugin requires another cache
        budget = 0
        if contended:
            try:
                spec, budget = budgeted(registry, spec, model, requests)
            except (PluginError, ValueError) as err:
                raise failing(f"{slot.value}={name}", label, err) from err
        expects = states_to_reach(registry, spec, budget, label == "preempting")
        out.append(Scenario(label, spec, expects=expects, budget_bytes=budget))
    return out


def build(registry: Registry, spec: dict[str, Any], model: LlamaModel, engine: EngineConfig, max_seq_len: int,
          hooks_for=lambda kv_cache: ()) -> BuiltArm:
    arm = resolve_arm("conformance", spec, baseline_configs(registry), registry)
    return build_arm(arm, model, engine, max_seq_len, registry, hooks_for)
