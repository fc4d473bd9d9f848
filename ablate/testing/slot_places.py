"""A cache that says where a decode step's rows go (KVCache.paged_slots) is held to it. A native layer
then writes those rows and reads that view itself, without calling write() or view() (on a CPU where
the native calls run: ablate/model/native_plan.py), so a cache naming rows that write() does not fill,
or a view that is not view()'s, would have it attend over stale keys: wrong logits, on some machines
only. On every decode step of a run, for every layer, after write(): the rows named hold the k and v
written, and the view is view()'s (the same pools, the same block tables).
"""
from __future__ import annotations

import torch

from ablate.api.context import EngineConfig
from ablate.api.kv import PagedKV, PagedPlaces
from ablate.api.kv_cache import KVCache
from ablate.api.plugin import Slot
from ablate.engine.registry import Registry
from ablate.model.llama import LlamaModel
from ablate.model.native_plan import two_calls_only
from ablate.testing.failures import ConformanceError
from ablate.testing.scenarios import MAX_NUM_SEQS, arm_spec, build, max_len, ragged_requests


def check_paged_slots(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> int:
    """The layer writes checked against the places a cache plugin gives (0: it gives none)."""
    if slot is not Slot.KV_CACHE or registry.get(slot, name).paged_slots is KVCache.paged_slots:
        return 0
    requests = ragged_requests(model.config.vocab_size)
    built = build(registry, arm_spec(registry, slot, name), model, EngineConfig(max_num_seqs=MAX_NUM_SEQS),
                  max_len(requests))
    cache, checked, problems = built.engine.runner.kv_cache, [], []
    write = cache.write

    def checked_write(layer: int, step, k: torch.Tensor, v: torch.Tensor) -> None:
        write(layer, step, k, v)
        places = cache.paged_slots(step) if step.is_decode else None
        if places is not None and not problems:       # the first problem is the one reported, after the run
            problem = _problem(cache, places, layer, step, k, v, model.config.n_layers)
            (problems if problem else checked).append(problem or layer)

    # every layer calls write() here (the instance's, checked), none runs the slots inside a native call
    with two_calls_only():
        cache.write = checked_write
        try:
            built.engine.run(requests)
        finally:
            built.close()
    if problems:
        raise ConformanceError(f"kv_cache={name} paged_slots(step) {problems[0]}; a native layer writes and reads "
                               "the places it gives instead of calling write() and view(): give the rows write() "
                               "fills and view()'s own PagedKV, or None")
    return len(checked)


def _problem(cache: KVCache, places: PagedPlaces, layer: int, step, k: torch.Tensor, v: torch.Tensor,
             n_layers: int) -> str | None:
    """What is wrong with `places` for `layer`, just written with k, v (T, H_kv, D), or None."""
    if not isinstance(places, PagedPlaces) or len(places.layers) != n_layers:
        return f"gave {type(places).__name__} {places!r:.80} for a model of {n_layers} layers: expected PagedPlaces"
    given = cache.view(layer, step)
    try:
        view, slots = places.view(layer), places.slots(layer)
    except IndexError as err:
        return f"gave layer {layer} a pool or group its tensors do not hold ({err})"
    if not isinstance(given, PagedKV):
        return f"gave places for layer {layer}, where view() gives a {type(given).__name__}"
    if (view.k_cache.data_ptr(), view.v_cache.data_ptr(), view.k_cache.shape, view.v_cache.shape) != (
            given.k_cache.data_ptr(), given.v_cache.data_ptr(), given.k_cache.shape, given.v_cache.shape) or not (
            torch.equal(view.block_tables, given.block_tables)):
        return f"gave layer {layer} pools or block tables other than view()'s"
    if slots.dtype != torch.long or slots.shape != (k.shape[0],):
        return f"gave layer {layer} slots {tuple(slots.shape)} {slots.dtype}, expected ({k.shape[0]},) int64"
    for name, pool, new in (("k", view.k_cache, k), ("v", view.v_cache, v)):
        if not torch.equal(pool.flatten(0, 1)[slots], new):
            return f"named rows of layer {layer}'s {name} pool that do not hold the {name} write() was given"
    return None
