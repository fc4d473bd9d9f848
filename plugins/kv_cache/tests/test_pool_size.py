"""The preallocated caches check their pool against the free memory before allocating anything.

A huge engine.max_num_seqs used to build one Python object per block of the paged pool (billions of
them, killed at 20 GB) or ask torch for terabytes (contiguous: "can't allocate ... bytes"). Now the
pool's size is checked first and one ValueError names the options to change and what would fit.
The free memory is pinned at 10 MB here, so the numbers do not depend on the machine.
"""
from __future__ import annotations

import time

import pytest

import ablate_kv_cache.slot_cache as slot_cache
from ablate.api.context import EngineConfig
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm

FREE = 10_000_000                  # bytes "free" on the device
MAX_SEQ_LEN = 40
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4   # the tiny model: K and V x layers x kv heads x head dim x fp32


@pytest.fixture(autouse=True)
def ten_megabytes_free(monkeypatch):
    monkeypatch.setattr(slot_cache, "free_memory_bytes", lambda device: FREE, raising=False)   # (old code: none)


def build(registry, model, kv_cache: dict, max_num_seqs: int):
    arm = resolve_arm("test", {"kv_cache": kv_cache}, baseline_configs(registry), registry)
    return build_arm(arm, model, EngineConfig(max_num_seqs=max_num_seqs), MAX_SEQ_LEN, registry, lambda kv: [])


@pytest.mark.parametrize("name, seq_bytes", [
    ("paged", 3 * 16 * BYTES_PER_TOKEN),      # ceil(40 / 16) blocks of 16 tokens
    ("contiguous", MAX_SEQ_LEN * BYTES_PER_TOKEN),
])
def test_a_pool_larger_than_the_free_memory_is_refused_before_it_is_built(name, seq_bytes, ablate_registry,
                                                                         ablate_tiny_model):
    fit = FREE // seq_bytes
    for max_num_seqs in (100_000, 10**12):     # 10**12: billions of blocks, terabytes of K/V
        start = time.perf_counter()
        with pytest.raises(ValueError) as err:
            build(ablate_registry, ablate_tiny_model, {"name": name}, max_num_seqs)
        assert time.perf_counter() - start < 5, "the check must come before anything is allocated"
        message = str(err.value)
        assert message.startswith(f"kv_cache={name}: the KV pool for engine.max_num_seqs={max_num_seqs} sequences "
                                  f"of {MAX_SEQ_LEN} tokens")
        assert f"needs {max_num_seqs * seq_bytes} bytes, more than the {FREE} bytes free in RAM" in message
        assert f"{fit} such sequences fit: lower engine.max_num_seqs to {fit} or below" in message
        for option in ("engine.max_seq_len", "kv_cache.budget_bytes", "kv_cache.budget_fraction"):
            assert option in message
    # what it says fits, fits
    built = build(ablate_registry, ablate_tiny_model, {"name": name}, fit)
    assert built.kv_cache.stats()["max_seqs_admitted"] == 0
    built.close()


def test_not_even_one_sequence_fitting_says_so(ablate_registry, ablate_tiny_model, monkeypatch):
    monkeypatch.setattr(slot_cache, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match="Not even one such sequence fits: shorten the sequences"):
        build(ablate_registry, ablate_tiny_model, {"name": "contiguous"}, 1)


@pytest.mark.parametrize("name", ["paged", "contiguous"])
def test_a_budget_beyond_the_free_memory_is_refused_naming_the_budget(name, ablate_registry, ablate_tiny_model):
    with pytest.raises(ValueError, match=rf"kv_cache={name}: the KV budget kv_cache.budget_bytes=1000000000 makes "
                                         rf"a pool of \d+ bytes, more than the {FREE} bytes free in RAM: lower "
                                         rf"the budget below {FREE} bytes \(kv_cache.budget_bytes, or "
                                         rf"kv_cache.budget_fraction"):
        build(ablate_registry, ablate_tiny_model, {"name": name, "budget_bytes": 10**9}, 10**9)
    # a budget larger than the pool needs caps nothing, so it is not what is checked
    built = build(ablate_registry, ablate_tiny_model, {"name": name, "budget_bytes": 10**15}, 8)
    built.close()


@pytest.mark.parametrize("name", ["paged", "contiguous"])
def test_a_budget_fraction_caps_a_huge_max_num_seqs_as_it_always_did(name, ablate_registry, ablate_tiny_model,
                                                                       monkeypatch):
    import ablate.api.kv as kv

    monkeypatch.setattr(kv, "free_memory_bytes", lambda device: FREE)     # what the fraction is of
    built = build(ablate_registry, ablate_tiny_model, {"name": name, "budget_fraction": 0.5}, 10**12)
    cache = built.kv_cache
    assert 0 < (cache.pool_bytes() if name == "paged" else cache.bytes_reserved()) <= FREE // 2
    built.close()
