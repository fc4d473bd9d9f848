"""Checks through the runner alone (kv_cache, attention and variant plugins), by teacher forcing: the
same texts fed token by token, as decoding would feed what it emits (ablate.engine.teacher).

- batch invariance: a sequence's logits do not depend on its batch mates. Texts run all at once
  must give what each gives alone, for exact and lossy plugins alike (a cache that hands sequence b
  another sequence's K/V fails it however it approximates);
- exactness: an exact plugin's logits equal the baseline runner's at every position (a cache that
  writes a position late, forgets decode tokens or a layer fails it, even where greedy tokens agree).

A cache or attention plugin is checked on the kit's Llama (K and V of several heads) and on an MLA
model too, whose cache holds one latent row per token in K and nothing in V (zero width).
"""
from __future__ import annotations

import random

import torch

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.engine.registry import Registry
from ablate.engine.teacher import teacher_forced_logits
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.testing.scenarios import ConformanceError, arm_spec, build

TEXT_LENGTHS = [(20, 6), (13, 2), (25, 11), (9, 4)]    # (tokens, prefill): ragged prompts and lengths
RELATIVE_TOLERANCE = 1e-3   # of the largest |logit|: rounding between implementations, far below a bug


def texts(vocab_size: int, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n, _ in TEXT_LENGTHS], [p for _, p in TEXT_LENGTHS]


def forced(registry: Registry, spec: dict, model: LlamaModel, batch: list[list[int]], prefill: list[int]
           ) -> list[torch.Tensor]:
    built = build(registry, spec, model, EngineConfig(max_num_seqs=len(batch)), max(len(t) for t in batch))
    try:
        return teacher_forced_logits(built.engine.runner, batch, prefill)
    finally:
        built.close()


def first_far(got: list[torch.Tensor], want: list[torch.Tensor], prefill: list[int]) -> tuple[int, int, float] | None:
    """(text, position, difference) of the first text whose logits differ from `want`'s by more
    than rounding (RELATIVE_TOLERANCE of the largest logit); None when none does."""
    for i, (a, b) in enumerate(zip(got, want)):
        diff = (a - b).abs()                                    # (n, V)
        if float(diff.max()) > RELATIVE_TOLERANCE * max(1.0, float(b.abs().max())):
            row = int(diff.argmax()) // a.shape[-1]
            return i, prefill[i] + row, float(diff.max())
    return None


def check_runner(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> list[str]:
    """Returns the models checked."""
    if slot not in (Slot.KV_CACHE, Slot.ATTENTION, Slot.MODEL):
        return []
    models = {model.config.name: model}
    if slot is not Slot.MODEL:
        models["mla-tiny"] = LlamaModel.random(preset("mla-tiny"))
    for label, checked in models.items():
        check_runner_on(registry, slot, name, checked, label)
    return list(models)


def check_runner_on(registry: Registry, slot: Slot, name: str, model: LlamaModel, label: str) -> None:
    plugin = f"{slot.value}={name}"
    spec = arm_spec(registry, slot, name)
    batch, prefill = texts(model.config.vocab_size)
    try:
        together = forced(registry, spec, model, batch, prefill)
        alone = [forced(registry, spec, model, [t], [p])[0] for t, p in zip(batch, prefill)]
    except PluginError as err:
        raise ConformanceError(f"{plugin} fails the kit under teacher forcing ({label} model): {err}") from err
    if far := first_far(together, alone, prefill):
        i, position, diff = far
        raise ConformanceError(
            f"{plugin} breaks batch invariance ({label} model): text {i}'s logits at position {position} differ "
            f"by {diff:.3g} when it runs beside {len(batch) - 1} other texts rather than alone: a sequence must "
            "only ever see its own K/V")
    if not registry.get(slot, name).exact:
        return
    if far := first_far(together, forced(registry, {}, model, batch, prefill), prefill):
        i, position, diff = far
        raise ConformanceError(
            f"{plugin} is declared exact but its logits ({label} model) differ from the baseline's by {diff:.3g} "
            f"at position {position} of text {i} (teacher forcing; rounding allows {RELATIVE_TOLERANCE:g} of the "
            "largest logit): a K/V written at the wrong position, a token or layer not stored, or a wrong view")
