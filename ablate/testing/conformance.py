"""The conformance kit: checks any plugin, built-in or third-party, against the engine's contract.

    from ablate.testing.conformance import check_plugin
    check_plugin("kv_cache", "my_cache")        # raises AssertionError naming what is wrong

Checks: the config dataclass round-trips through Hydra's ConfigStore and composition; declared
requirements are enforced (the plugin is refused beside a plugin it does not support, naming
both); a plugin that declares itself exact gives the baseline's greedy tokens, token for token,
on a ragged batch whose sequences finish at different steps; one that is not exact declares a
quality bound (`Plugin.quality`) and stays within it; the declared stats keys appear.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ablate.engine.arm import BASELINE, BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.api.context import EngineConfig
from ablate.model.config import preset
from ablate.model.llama import LlamaModel
from ablate.api.plugin import IncompatiblePlugins, Plugin, Slot, check_compatible
from ablate.measure.quality import runner_perplexity
from ablate.engine.registry import Registry, default_registry
from ablate.api.sequence import Request, SamplingParams, Sequence

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# the slots a forward pass of the runner goes through: what teacher-forced perplexity can score
RUNNER_SLOTS = (Slot.MODEL, Slot.KV_CACHE, Slot.ATTENTION)

# prompts of different lengths and outputs that end at different steps
RAGGED = [(3, 5), (9, 11), (17, 8), (6, 1)]


def arm_spec(registry: Registry, slot: Slot, name: str) -> dict[str, Any]:
    """The baseline with `slot` replaced by the plugin, and whatever it requires satisfied."""
    cls = registry.get(slot, name)
    spec: dict[str, Any] = {slot.value: name}
    for need in cls.requires:
        if BASELINE[need.slot] not in need.names:
            available = sorted(n for n in need.names if n in registry.choices(need.slot))
            assert available, f"{slot.value}={name} requires {need.slot.value} in {sorted(need.names)}, none installed"
            spec[need.slot.value] = available[0]
    return spec


def ragged_requests(vocab_size: int, seed: int = 0) -> list[Request]:
    import random
    rng = random.Random(seed)
    return [Request(i, tuple(rng.randrange(vocab_size) for _ in range(p)), n) for i, (p, n) in enumerate(RAGGED)]


def run_arm(registry: Registry, spec: dict[str, Any], model: LlamaModel) -> tuple[list[Sequence], BuiltArm]:
    arm = resolve_arm("conformance", spec, baseline_configs(registry), registry)
    requests = ragged_requests(model.config.vocab_size)
    max_len = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=len(requests)), max_len, registry)
    return built.engine.run(requests), built


def check_config_roundtrip(registry: Registry, slot: Slot, name: str) -> None:
    """Default config -> Hydra composition (`<slot>=<name>`) -> dataclass again: equal."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ablate.engine.registry import register_configs

    cls = registry.get(slot, name)
    default = cls.config_class()
    assert default.name == name, f"{cls.config_class.__name__}().name is {default.name!r}, expected {name!r}"
    register_configs(registry)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=[f"{slot.value}={name}"])
    node = OmegaConf.to_container(composed[slot.value], resolve=True)
    rebuilt = registry.config(slot, name, node)
    assert rebuilt == default, f"{slot.value}={name}: config changed through Hydra: {rebuilt} != {default}"
    again = registry.config(slot, name, dataclasses.asdict(rebuilt))
    assert again == default, f"{slot.value}={name}: config does not round-trip through a dict"


def check_requirements_enforced(registry: Registry, slot: Slot, name: str) -> None:
    """Each declared requirement refuses a combination that breaks it, naming both plugins."""
    cls = registry.get(slot, name)
    for need in cls.requires:
        others = [n for n in registry.choices(need.slot) if n not in need.names]
        for other in others:
            combo = {s: registry.get(s, n) for s, n in BASELINE.items()}
            combo[slot] = cls
            combo[need.slot] = registry.get(need.slot, other)
            try:
                check_compatible(combo)
            except IncompatiblePlugins as err:
                assert name in str(err) and other in str(err), f"the refusal does not name both plugins: {err}"
            else:
                raise AssertionError(f"{slot.value}={name} ran beside {need.slot.value}={other}, "
                                     f"which its requirement ({need.reason}) excludes")


def check_greedy_matches_baseline(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> BuiltArm:
    """Exact plugins: the baseline's greedy tokens for every request. Returns the plugin's arm."""
    baseline, _ = run_arm(registry, {}, model)
    seqs, built = run_arm(registry, arm_spec(registry, slot, name), model)
    cls = registry.get(slot, name)
    for want, got in zip(baseline, seqs):
        assert got.is_finished, f"{slot.value}={name}: request {got.seq_id} did not finish"
        if cls.exact:
            assert got.output_token_ids == want.output_token_ids, (
                f"{slot.value}={name} is declared exact but request {got.seq_id} gave "
                f"{got.output_token_ids}, the baseline {want.output_token_ids}")
        else:
            assert got.num_output_tokens == want.num_output_tokens, (
                f"{slot.value}={name}: request {got.seq_id} emitted {got.num_output_tokens} tokens, "
                f"expected {want.num_output_tokens}")
    return built


def sampled_text(registry: Registry, model: LlamaModel, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` tokens the baseline writes itself: a seeded first token, then sampling at temperature 1.

    Why its own text: for x drawn from the baseline's p, E[log p(x) - log q(x)] = KL(p || q) >= 0,
    so perplexity(plugin q) / perplexity(baseline p) on it estimates exp(mean per-token KL): how far
    the plugin moves the model's predictions, meaningful even on random weights, where no real
    text has structure the model knows.
    """
    import random
    first = random.Random(seed).randrange(model.config.vocab_size)
    request = Request(0, (first,), num_tokens - 1, SamplingParams(temperature=1.0, seed=seed))
    built = build_arm(resolve_arm("baseline", {}, baseline_configs(registry), registry), model,
                      EngineConfig(max_num_seqs=1), num_tokens, registry)
    seq = built.engine.run([request])[0]
    built.close()
    return seq.token_ids


def arm_perplexity(registry: Registry, spec: dict[str, Any], model: LlamaModel, token_ids: list[int]) -> float:
    """Teacher-forced perplexity of `token_ids` through the arm's own runner (its plugins in the path)."""
    arm = resolve_arm("quality", spec, baseline_configs(registry), registry)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=1), len(token_ids), registry)
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
    assert bound is not None, (
        f"{slot.value}={name} declares exact = False but no quality bound: set `quality = QualityBound("
        f"max_ratio=..., num_tokens=..., config={{...}})` (ablate.api.plugin) on {cls.__name__}, the largest "
        "perplexity ratio to the baseline it may cost, so that the kit can check it")
    assert slot in RUNNER_SLOTS, (
        f"{slot.value}={name} is not exact, but the kit scores quality by teacher forcing through the "
        f"runner, which a {slot.value} plugin is not part of: it cannot check this plugin's bound")
    token_ids = token_ids or sampled_text(registry, model, bound.num_tokens)
    spec = arm_spec(registry, slot, name)
    spec[slot.value] = {"name": name, **bound.config}
    baseline = arm_perplexity(registry, {}, model, token_ids)
    got = arm_perplexity(registry, spec, model, token_ids)
    options = " ".join(f"{slot.value}.{k}={v}" for k, v in bound.config.items())
    assert got <= bound.max_ratio * baseline, (
        f"{slot.value}={name}{' (' + options + ')' if options else ''}: perplexity {got:.3f} against the "
        f"baseline's {baseline:.3f} over {len(token_ids)} tokens, ratio {got / baseline:.3f} exceeds the "
        f"declared bound {bound.max_ratio}")
    return baseline, got


def check_stats(built: BuiltArm, plugin: Plugin) -> None:
    stats = plugin.stats()
    missing = [k for k in type(plugin).stats_keys if k not in stats]
    assert not missing, f"{plugin.slot.value}={plugin.name} declares stats {missing} but stats() lacks them"


def check_plugin(slot: Slot | str, name: str, registry: Registry | None = None,
                 model: LlamaModel | None = None) -> None:
    """Every check above, on the tiny model."""
    slot = Slot(slot)
    registry = registry or default_registry()
    model = model or LlamaModel.random(preset("tiny"))
    check_config_roundtrip(registry, slot, name)
    check_requirements_enforced(registry, slot, name)
    built = check_greedy_matches_baseline(registry, slot, name, model)
    check_stats(built, built.plugins[slot])
    built.close()
    check_quality(registry, slot, name, model)
