"""attention=paged: shapes the Triton paged-decode kernel does not take are refused when the plugin is
built (backend=triton) or run through the PyTorch gather with a warning (backend=auto); and MLA
(its prefill hands attention a PaddedKV, its absorbed decode a PagedKV with V = K) runs through
attention=paged with kv_cache=paged. The kernel runs on the CPU under Triton's interpreter, switched
on before triton is first imported (hence the environment line above the imports)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import warnings  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import ablate_kernels  # noqa: E402
from ablate.api.context import EngineConfig  # noqa: E402
from ablate.api.kv import KVSpec, PagedKV  # noqa: E402
from ablate.api.plugin import Slot  # noqa: E402
from ablate.api.sequence import Request  # noqa: E402
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm  # noqa: E402
from ablate.model.presets import preset  # noqa: E402
from ablate.model.llama import LlamaModel  # noqa: E402
from ablate.model.mla import set_absorbed  # noqa: E402
from ablate.api import native  # noqa: E402
from ablate_attention import paged as paged_attention  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")
needs_triton = pytest.mark.skipif(
    not ablate_kernels.triton_available("cpu"),
    reason="triton was imported before TRITON_INTERPRET=1 was set (run this module on its own)")

PAGED = {"kv_cache": {"name": "paged", "block_size": 4}}
REQUESTS = [Request(0, (3, 1, 4, 1, 5), 4), Request(1, (9, 2, 6), 5)]     # a ragged batch
NARROW_MLA = {"name": "mla", "rank": 12, "rope_frequencies": 4}         # tiny -> rows of 12 + 2*4*2 = 28


def run(registry, model, spec):
    arm = resolve_arm("t", spec, baseline_configs(registry), registry)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=2), 16, registry)
    return [s.output_token_ids for s in built.engine.run(REQUESTS)], built.plugins[Slot.ATTENTION]


def paged(backend: str, **more) -> dict:
    return {**PAGED, "attention": {"name": "paged", "backend": backend}, **more}


def fake_ctx(attention_kind: str, head_dim: int, k_width: int, v_width: int, dtype=torch.float32):
    spec = KVSpec(2, 1, k_width, v_width, dtype, torch.device("cpu"), 1, 8)
    return SimpleNamespace(kv_spec=spec, model=SimpleNamespace(config=SimpleNamespace(
        name="fake", attention_kind=attention_kind, head_dim=head_dim, kv_latent_dim=k_width - 64, rope_head_dim=64)))


@pytest.mark.parametrize("ctx, problem", [
    (fake_ctx("mha", 64, 64, 64), None),                                           # SmolLM2's heads
    (fake_ctx("mha", 96, 96, 96), "head_dim 96 is not a power of two in 16..256"),
    (fake_ctx("mla", 128, 512 + 64, 0), "head_dim 576 is not a power of two in 16..256"),   # absorbed rows
    (fake_ctx("mla", 16, 32, 0), None),                                            # mla-tiny: 16 + 16, V = K
    (fake_ctx("mha", 32, 32, 16), "K/V widths 32/16 differ from the query's 32"),
    (fake_ctx("mha", 32, 32, 32, torch.float64), "dtype torch.float64 is not fp16, bf16 or fp32"),
])
def test_shapes_the_kernel_does_not_take_are_known_from_the_build_context(ctx, problem):
    assert paged_attention.decode_shape_problem(ctx) == problem


def test_backend_triton_refuses_a_model_the_kernel_cannot_take(ablate_registry, ablate_tiny_model, monkeypatch):
    monkeypatch.setattr(ablate_kernels, "triton_available", lambda device: True)   # the shape is what is refused
    arm = resolve_arm("t", paged("triton", variant=NARROW_MLA), baseline_configs(ablate_registry), ablate_registry)
    with pytest.raises(ValueError) as refused:
        build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=2), 16, ablate_registry)
    message = str(refused.value)
    assert message.startswith("attention=paged backend=triton: the paged-decode kernel cannot take model 'tiny': "
                              "head_dim 28 is not a power of two in 16..256")
    assert "model.kv_latent_dim + model.rope_head_dim = 12 + 16 wide" in message
    assert "use attention.backend=auto" in message and "attention.backend=torch" in message


def test_backend_triton_refuses_a_step_it_cannot_take(ablate_registry, ablate_tiny_model, monkeypatch):
    monkeypatch.setattr(ablate_kernels, "triton_available", lambda device: True)
    _, attention = run(ablate_registry, ablate_tiny_model, paged("torch"))         # built without the check
    attention.decode_kernel, attention.forced = "triton", True
    q, cache = torch.zeros(1, 4, 24), torch.zeros(2, 4, 2, 24)                       # head_dim 24
    step = SimpleNamespace(is_decode=True, memo=lambda key, make: make())      # what the check reads of a step
    with pytest.raises(ValueError, match="backend=triton: the paged-decode kernel cannot take this step: head_dim 24"):
        attention(q, PagedKV(cache, cache, torch.zeros(1, 1, dtype=torch.int32)), step)


@pytest.mark.parametrize("variant", ["narrow mla", "explicit mla decode"])
def test_backend_auto_runs_the_pytorch_gather_where_the_kernel_cannot(variant, ablate_registry, ablate_tiny_model,
                                                                      monkeypatch):
    monkeypatch.setattr(ablate_kernels, "triton_available", lambda device: True)   # the kernel is never reached
    monkeypatch.setattr(paged_attention.native, "available", lambda: False)        # auto takes Triton, as on a GPU
    monkeypatch.setattr(paged_attention, "_warned", set())
    if variant == "narrow mla":
        model, extra = ablate_tiny_model, {"variant": NARROW_MLA}
        expected = "paged(decode=torch(head_dim 28 is not a power of two in 16..256),prefill=torch)"
    else:   # decode through MLA's explicit path: attention gets a PaddedKV, no block tables
        model, extra = set_absorbed(LlamaModel.random(preset("mla-tiny")), False), {}
        expected = "paged(decode=torch,prefill=torch)"
    baseline, _ = run(ablate_registry, model, extra)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tokens, attention = run(ablate_registry, model, paged("auto", **extra))
        run(ablate_registry, model, paged("auto", **extra))                       # a second arm: no second warning
    assert tokens == baseline
    assert attention.backend == expected
    shape_warnings = [str(w.message) for w in said if "paged-decode kernel does not take" in str(w.message)]
    assert len(shape_warnings) == (variant == "narrow mla")


@pytest.mark.parametrize("backend", ["auto", "torch", pytest.param("triton", marks=needs_triton),
                                     pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("source", ["mla-tiny", "variant=mla"])
def test_mla_prefill_and_decode_through_paged_attention_and_a_paged_cache(backend, source, ablate_registry,
                                                                         ablate_tiny_model):
    if source == "mla-tiny":
        model, extra = LlamaModel.random(preset("mla-tiny")), {}
    else:
        model, extra = ablate_tiny_model, {"variant": "mla"}      # full rank, RoPE kept: rows 32 + 32 wide
    baseline, _ = run(ablate_registry, model, extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                            # no Triton here is warned about elsewhere
        tokens, attention = run(ablate_registry, model, paged(backend, **extra))
    assert tokens == baseline
    if backend == "auto" and native.available():     # on the CPU: the native kernel or the gather, timed
        assert re.fullmatch(r"paged\(decode=(native|torch)\(.*timed: .*\),prefill=torch\)", attention.backend)
        return
    if backend == "auto":        # without native kernels: Triton's interpreter, else the gather, untimed
        backend = "triton" if ablate_kernels.triton_available("cpu") else "torch"
    kernel = ablate_kernels.backend_label("cpu") if backend == "triton" else backend
    assert attention.backend == f"paged(decode={kernel},prefill=torch)"


@pytest.mark.parametrize("variant, message", [
    ("gqa", "variant=gqa converts per-head K/V projections (model.attention_kind=mha); model 'mla-tiny' uses "
            "attention_kind=mla, whose K/V heads it cannot pool: run it with variant=none"),
    ("mla", "variant=mla converts Llama-family K/V projections without biases or norms (model.attention_kind=mha, "
            "qkv_bias=False, qk_norm=False); model 'mla-tiny' has attention_kind=mla, qkv_bias=False, qk_norm=False: "
            "run it with variant=none"),
])
def test_a_variant_the_model_cannot_take_is_one_message_with_the_fix(variant, message, ablate_registry):
    arm = resolve_arm("t", {"variant": variant, **paged("auto")}, baseline_configs(ablate_registry), ablate_registry)
    with pytest.raises(ValueError) as refused:
        build_arm(arm, LlamaModel.random(preset("mla-tiny")), EngineConfig(max_num_seqs=2), 16, ablate_registry)
    assert str(refused.value) == message
