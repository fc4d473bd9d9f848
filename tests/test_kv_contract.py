"""The KV cache's final methods are final in fact: the core calls them, and a cache class that
defines one is refused when it is created, naming the method, and a plugin package holding such a
class is a broken plugin (the rest of discovery goes on)."""
from __future__ import annotations

import pytest

from ablate.api import KVCache
from ablate.api.plugin import Slot
from ablate.engine.registry import discover
from ablate_kv_cache.contiguous import ContiguousKVCache
from fake_distributions import fake_distribution

FINAL = sorted(name for name, attr in vars(KVCache).items() if getattr(attr, "__ablate_final__", False))


def test_the_methods_the_core_calls_are_the_final_ones():
    assert FINAL == ["allocate", "begin_step", "commit", "num_committed", "release", "room", "room_holders"]


@pytest.mark.parametrize("name", FINAL)
@pytest.mark.parametrize("base", [KVCache, ContiguousKVCache], ids=["KVCache", "a built-in cache"])
def test_a_cache_that_overrides_a_final_method_is_refused_at_class_creation(name, base):
    with pytest.raises(TypeError, match=rf"Sly overrides KVCache\.{name}, which the core calls"):
        type("Sly", (base,), {name: lambda self, *args: None})


def test_the_methods_left_to_plugins_may_be_overridden():
    type("Fine", (ContiguousKVCache,), {"keep": lambda self, seq, n: None, "prepare": lambda self, step: None})


def test_a_package_with_such_a_cache_is_a_broken_plugin(tmp_path, monkeypatch):
    code = ("from ablate.api import KVCache\n"
            "class Cache(KVCache):\n"
            "    name = 'sly'\n"
            "    def commit(self, seq, num_tokens):\n"
            "        pass\n")
    fake_distribution(tmp_path, "ablate-sly", "1.0", {"kv_cache.sly": "ablate_sly_cache:Cache"},
                      {"ablate_sly_cache": code})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"kv_cache\.sly.*overrides KVCache\.commit"):
        reg = discover()
    assert "contiguous" in reg.choices(Slot.KV_CACHE) and "sly" not in reg.choices(Slot.KV_CACHE)


def test_the_committed_count_is_the_sequences_own(build):
    """The cache keeps no copy of what a sequence committed: it reads num_computed_tokens, and a commit
    of any other count is refused naming both."""
    from ablate.api import PluginError, Request, Sequence

    cache = build({"kv_cache": "contiguous"}).kv_cache
    seq = Sequence(Request(0, (1, 2, 3, 4), 4))
    seq.start()
    assert cache.allocate(seq, 4)
    seq.advance(4, [5])                               # 4 computed, 5 tokens
    with pytest.raises(PluginError, match="3 tokens committed .* but it has 4 computed"):
        cache.commit(seq, 3)
    cache.commit(seq, 4)
    assert cache.num_committed() == {0: 4} and cache.bytes_used() == 4 * cache.bytes_per_token
    cache.release(seq)
    assert cache.num_committed() == {} and cache.bytes_used() == 0
