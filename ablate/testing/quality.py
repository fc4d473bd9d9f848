"""The kit's check of a plugin that is not exact: the perplexity it costs stays within the bound it
declares (Plugin.quality), measured by teacher forcing through the plugin's arm."""
from __future__ import annotations

import random
from typing import Any

from ablate.api.context import EngineConfig
from ablate.api.plugin import Slot
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.registry import Registry
from ablate.measure.quality import runner_perplexity
from ablate.model.llama import LlamaModel
from ablate.testing.scenarios import ConformanceError, arm_spec, build

# the slots a forward pass of the runner goes through: what teacher-forced perplexity can score
RUNNER_SLOTS = (Slot.MODEL, Slot.KV_CACHE, Slot.ATTENTION)


def sampled_text(registry: Registry, model: LlamaModel, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` tokens the baseline writes itself: a seeded first token, then sampling at temperature 1.

    Why its own text: for x drawn from the baseline's p, E[log p(x) - log q(x)] = KL(p || q) >= 0,
    so perplexity(plugin q) / perplexity(baseline p) on it estimates exp(mean per-token KL): how far
    the plugin moves the model's predictions, meaningful even on random weights, where no real
    text has structure the model knows.
    """
    first = random.Random(seed).randrange(model.config.vocab_size)
    request = Request(0, (first,), num_tokens - 1, SamplingParams(temperature=1.0, seed=seed))
    built = build(registry, {}, model, EngineConfig(max_num_seqs=1), num_tokens)
    try:
        return built.engine.run([request])[0].token_ids
    finally:
        built.close()


def arm_perplexity(registry: Registry, spec: dict[str, Any], model: LlamaModel, token_ids: list[int]) -> float:
    """Teacher-forced perplexity of `token_ids` through the arm's own runner (its plugins in the path)."""
    built = build(registry, spec, model, EngineConfig(max_num_seqs=1), len(token_ids))
    try:
        return runner_perplexity(built.engine.runner, token_ids)
    finally:
        built.close()


def check_quality(registry: Registry, slot: Slot, name: str, model: LlamaModel,
                  token_ids: list[int] | None = None) -> tuple[float, float] | None:
    """Plugins that are not exact: perplexity through the plugin's arm / the baseline's <= the
    declared bound, on `token_ids` (default: `sampled_text` of the bound's length). Returns
    (baseline's perplexity, the plugin's); None for an exact plugin (its tokens are checked instead)."""
    cls = registry.get(slot, name)
    if cls.exact:
        return None
    bound = cls.quality
    if slot not in RUNNER_SLOTS:
        raise ConformanceError(f"{slot.value}={name} is not exact, but the kit scores quality by teacher forcing "
                               f"through the runner, which a {slot.value} plugin is not part of: it cannot check "
                               "this plugin's bound")
    token_ids = token_ids or sampled_text(registry, model, bound.num_tokens)
    spec = arm_spec(registry, slot, name)
    spec[slot.value] = {"name": name, **bound.config}
    baseline = arm_perplexity(registry, {}, model, token_ids)
    got = arm_perplexity(registry, spec, model, token_ids)
    options = " ".join(f"{slot.value}.{k}={v}" for k, v in bound.config.items())
    if got > bound.max_ratio * baseline:
        raise ConformanceError(
            f"{slot.value}={name}{' (' + options + ')' if options else ''}: perplexity {got:.3f} against the "
            f"baseline's {baseline:.3f} over {len(token_ids)} tokens, ratio {got / baseline:.3f} exceeds the "
            f"declared bound {bound.max_ratio}")
    return baseline, got
