"""No built-in arm makes the host wait for the device more than a few times a decode step, and none
inside a layer (ablate/testing/syncs.py counts the calls that would, on a CPU)."""
from __future__ import annotations

import pytest

import torch

from ablate.testing.syncs import (BUILT_IN_ARMS, MAX_HOST_COPIES_PER_DECODE_STEP, MAX_HOST_COPIES_PER_DRAFT,
                                  MAX_SYNCS_PER_DECODE_STEP, count_syncs, summary)


@pytest.mark.parametrize("record", [False, True], ids=["unrecorded", "recorded"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "graphs" else n   # compiles: slow
                                  for n in BUILT_IN_ARMS])
def test_decode_steps_make_few_host_syncs_and_copies_and_none_per_layer(name, record, build, make_requests):
    spec, per_draft = BUILT_IN_ARMS[name]
    found = summary(count_syncs(build(spec, record=record), make_requests([5, 9, 12], [6, 4, 8])))
    assert found["decode_steps"] > 0
    assert found["max_per_step"] <= MAX_SYNCS_PER_DECODE_STEP + per_draft, found["calls"]
    assert found["max_per_layer"] == 0, found["calls"]
    assert found["max_host_copies_per_step"] <= MAX_HOST_COPIES_PER_DECODE_STEP + MAX_HOST_COPIES_PER_DRAFT * per_draft
    assert found["max_host_copies_per_layer"] == 0


def test_unrecorded_steps_of_a_plain_arm_wait_for_the_device_once(build, make_requests):
    """The sampled tokens are the step's one sync: the clock adds none when no hook times the steps."""
    found = summary(count_syncs(build({"kv_cache": "contiguous"}, record=False), make_requests([5, 9], [6, 4])))
    assert found["max_per_step"] == 1 and "synchronize" not in found["calls"], found["calls"]


def test_the_counter_sees_a_pageable_copy_inside_a_layer(build, make_requests):
    """torch.tensor(host list, device=...) in a layer: a host-to-device copy per layer, and on a GPU a
    blocking one (pageable memory): counted as a sync too."""
    built = build({"kv_cache": "contiguous"}, record=False)
    layer = built.engine.runner.model.layers[1]
    hook = layer.register_forward_hook(lambda module, args, out: [torch.tensor([1, 2], device=out.device)] and None)
    try:
        found = summary(count_syncs(built, make_requests([5], [4])))
    finally:
        hook.remove()
    assert found["max_host_copies_per_layer"] == 1 and found["max_per_layer"] == 1
    assert found["calls"]["pageable host-to-device copy"] >= 3


def test_the_counter_sees_a_sync_inside_a_layer(build, make_requests):
    built = build({"kv_cache": "contiguous"}, record=False)
    layer = built.engine.runner.model.layers[1]
    hook = layer.register_forward_hook(lambda module, args, out: None if bool(out.sum() > 0) else None)   # a sync
    try:
        found = summary(count_syncs(built, make_requests([5], [4])))
    finally:
        hook.remove()
    assert found["max_per_layer"] == 1 and found["calls"]["__bool__"] >= 3
