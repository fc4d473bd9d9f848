"""A decode step's plain layer in one native call, its cache's write and the native paged attention
inside (ablate/model/native_plan.py, layers.c's layer_paged_decode): taken only where the arm's cache
says where its rows go and its attention runs that kernel, giving the bits of the layer's slots; never
where a plugin does more in a slot, runs another kernel, or the cache is not what the kernel takes."""
import contextlib
import dataclasses

import pytest
import torch

from ablate.api.context import EngineConfig
from ablate.api.kv import PagedPlaces
from ablate.api.plugin import PluginError
from ablate.api.sequence import Request
from ablate.engine.runner import ModelRunner
from ablate.model import native
from ablate.model.llama import LlamaModel
from ablate.model.native.layers import LayerCalls, PagedDecode
from ablate.model.native_plan import two_calls_only
from ablate.model.presets import preset
from ablate.model.product_paths import NATIVE
from ablate.testing.scenarios import build
from ablate_kv_cache.paged import PagedKVCache

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")

PROMPTS = (20, 5, 11, 14)       # tokens: a prefill past 16 rows, mixed steps, then decode steps of 1 to 4 rows


def arm(backend: str = "native") -> dict:
    return {"kv_cache": {"name": "paged", "block_size": 4}, "attention": {"name": "paged", "backend": backend}}


def run(registry, model: LlamaModel, arm: dict, batch: int, one_call: bool = True):
    """Greedy decode of `batch` requests; every step's logits, whether it was a decode step, and the
    runner's layer counts."""
    logits, decode = [], []
    eager_logits = ModelRunner._logits

    def logged(self, step):
        decode.append(step.is_decode)
        logits.append(eager_logits(self, step))
        return logits[-1]

    with pytest.MonkeyPatch.context() as mp, contextlib.nullcontext() if one_call else two_calls_only():
        mp.setattr(ModelRunner, "_logits", logged)
        built = build(registry, arm, model, EngineConfig(max_num_seqs=batch), 96)
        try:
            built.engine.run([Request(i, tuple(range(3 + i, 3 + i + n)), 10) for i, n in enumerate(PROMPTS[:batch])])
            return logits, decode, built.engine.runner.layer_stats()
        finally:
            built.close()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", [{}, {"qkv_bias": True}, {"n_kv_heads": 1}, {"n_kv_heads": 4, "head_dim": 8}])
def test_one_call_gives_the_slots_bits(batch, shape, ablate_registry, fresh_product_paths):
    """Every logit of every step equal, bit for bit, with each decode step's layers after the first in
    one call and with every layer calling the slots; every layer of every decode step but the first
    (whose slot calls decide the attention's kernel) ran in one call."""
    model = LlamaModel.random(preset("tiny", **shape))
    fresh_product_paths.force(NATIVE)
    want, _, counts = run(ablate_registry, model, arm(), batch, one_call=False)
    assert counts["one_call_layers"] == 0 and counts["native_layers"] > 0
    got, decode, counts = run(ablate_registry, model, arm(), batch)
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {(a - b).abs().max():.3g}"
    assert counts["one_call_layers"] == sum(decode) * (model.config.n_layers - 1) > 0


class WritesMore(PagedKVCache):
    """A paged cache whose write() does more than copy the rows (notes each layer): its layers must call it."""
    written: list[int] = []

    def write(self, layer, step, k, v) -> None:
        self.written.append(layer)
        super().write(layer, step, k, v)


@pytest.mark.parametrize("case", ["write overridden", "attention on the gather", "no paged slots"])
def test_a_slot_that_does_more_or_another_kernel_keeps_every_layer_on_the_slots(case, ablate_registry,
                                                                                fresh_product_paths, monkeypatch):
    """A cache whose write() does more than the copy, an attention whose decode steps take another
    kernel (the gather), or a cache that gives no places: every layer calls the slots, with the bits of
    the layers' two calls."""
    model = LlamaModel.random(preset("tiny"))
    fresh_product_paths.force(NATIVE)
    registry = ablate_registry.with_plugins(WritesMore) if case == "write overridden" else ablate_registry
    want, _, _ = run(ablate_registry, model, arm("torch" if case == "attention on the gather" else "native"), 2,
                     one_call=False)
    if case == "no paged slots":
        monkeypatch.setattr(PagedKVCache, "paged_slots", lambda self, step: None)
    WritesMore.written.clear()
    got, _, counts = run(registry, model, arm("torch" if case == "attention on the gather" else "native"), 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert counts["one_call_layers"] == 0 and counts["native_layers"] > 0
    if case == "write overridden":
        assert WritesMore.written == list(range(model.config.n_layers)) * len(got)


def test_written_where_the_slots_would_and_refused_where_the_kernel_would_read_astray():
    """The call writes k and v to the rows the cache names and attends as the attention's kernel does;
    what the C code would trust and read past (a slot outside the pool, a pool of another shape or
    dtype, tables of another batch, a layer's pool or group not held) makes no PagedDecode."""
    torch.manual_seed(0)
    d, heads, kv_heads, dim, f, bs, blocks = 16, 4, 2, 8, 24, 4, 6
    norm = torch.ones(d)
    calls = LayerCalls(norm, 1e-5, torch.randn((heads + 2 * kv_heads) * dim, d), None, torch.randn(d, heads * dim),
                       norm, 1e-5, torch.randn(2 * f, d), torch.randn(d, f), heads, kv_heads, dim, 1)
    k_pools, v_pools = (torch.randn(2, blocks, bs, kv_heads, dim) for _ in range(2))     # two layers' pools
    tables = torch.tensor([[[3, 1, 0], [5, 2, 4]]], dtype=torch.int32)                 # one group, 2 sequences
    lens = torch.tensor([7, 10], dtype=torch.int32)              # each sequence's new key is its last
    slots = torch.tensor([[1 * bs + 2, 4 * bs + 1]])              # position 6 of sequence 0, 9 of sequence 1
    places = PagedPlaces(k_pools, v_pools, slots, tables, ((0, 0), (1, 0)))
    x, cos, sin = torch.randn(2, d), torch.randn(2, 1, dim), torch.randn(2, 1, dim)
    scratch = torch.empty(2 * calls.scratch_floats)

    # layer 1 as the two calls around the slots' work would run it, on copies
    k_ref, v_ref, x_ref = k_pools[1].clone(), v_pools[1].clone(), x.clone()
    q, k, v = (t[0] for t in calls.outputs(2))
    calls.qkv(x_ref, cos, sin, scratch, (q, k, v))
    k_ref.flatten(0, 1).index_copy_(0, slots[0], k)
    v_ref.flatten(0, 1).index_copy_(0, slots[0], v)
    attn = native.paged_decode_attention(q, k_ref, v_ref, tables[0], lens, 1)
    calls.out_mlp(x_ref, attn, scratch)

    untouched = k_pools[0].clone(), v_pools[0].clone()
    paged = PagedDecode.of(calls, places, lens, 2, 2)
    calls.paged_decode(x, cos, sin, scratch, paged.layers[1])
    assert torch.equal(k_pools[1], k_ref) and torch.equal(v_pools[1], v_ref) and torch.equal(x, x_ref)
    assert torch.equal(k_pools[0], untouched[0]) and torch.equal(v_pools[0], untouched[1])

    for bad in ({"slot_mapping": torch.tensor([[0, blocks * bs]])}, {"slot_mapping": torch.tensor([[-1, 3]])},
                {"slot_mapping": slots.int()}, {"slot_mapping": slots[:, :1]},
                {"k": torch.randn(2, blocks, bs, kv_heads, dim + 1)}, {"k": k_pools.double()},
                {"v": v_pools[:, :, :2]}, {"block_tables": tables[:, :1]}, {"block_tables": tables.long()},
                {"k": k_pools.transpose(2, 3).contiguous().transpose(2, 3)}, {"layers": ((0, 0), (2, 0))},
                {"layers": ((0, 0), (1, 1))}, {"layers": ((0, 0),)}):
        assert PagedDecode.of(calls, dataclasses.replace(places, **bad), lens, 2, 2) is None, bad


class PlacesFail(PagedKVCache):
    """A paged cache whose paged_slots raises."""

    def paged_slots(self, step):
        raise RuntimeError("no places today")


def test_a_plugin_failing_to_say_where_its_rows_go_is_named(ablate_registry, fresh_product_paths):
    """A failure inside paged_slots (or native_paged_decode) fails the arm as the plugin's, naming the
    method, like a failure in any slot."""
    model = LlamaModel.random(preset("tiny"))
    fresh_product_paths.force(NATIVE)
    with pytest.raises(PluginError, match=r"kv_cache=paged\.paged_slots: RuntimeError: no places today"):
        run(ablate_registry.with_plugins(PlacesFail), model, arm(), 1)
