"""A decoder layer's dense arithmetic as two native calls (ablate/model/native/layers.py): taken only where
the eager path would run the same kernels, so that every logit keeps its bits; never where it would
compute otherwise; decided again when a product's path or a weight's layout changes."""
import pytest
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.engine.runner import ModelRunner
from ablate.model import native
from ablate.model.llama import LlamaModel
from ablate.model.native.layers import LayerCalls
from ablate.model.native_plan import NativePlans
from ablate.model.presets import preset
from ablate.model.linear import Linear
from ablate.model.product_paths import MKL, NATIVE, ROW_MAJOR
from ablate.testing.scenarios import build

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")

PROMPTS = (20, 5, 11, 14)       # tokens
ARMS = {"contiguous+sdpa": {"kv_cache": "contiguous", "attention": "sdpa"},
        "paged+paged": {"kv_cache": "paged", "attention": "paged"}}


def run(registry, model: LlamaModel, arm: dict, batch: int, native_layers: bool = True):
    """Greedy decode of `batch` requests (prompts of 20, 5, 11 and 14 tokens: prefills past 16 rows, and
    steps of 1 to 16); returns every step's logits and the runner's layer counts."""
    logits = []
    eager_logits = ModelRunner._logits
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "_logits", lambda self, step: logits.append(eager_logits(self, step)) or logits[-1])
        if not native_layers:
            mp.setattr(NativePlans, "for_step", lambda self, layers, x, fwd: None)
        built = build(registry, arm, model, EngineConfig(max_num_seqs=batch), 96)
        try:
            built.engine.run([Request(i, tuple(range(3 + i, 3 + i + n)), 10) for i, n in enumerate(PROMPTS[:batch])])
            return logits, built.engine.runner.layer_stats()
        finally:
            built.close()


@pytest.mark.parametrize("arm", sorted(ARMS))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", [{}, {"qkv_bias": True}, {"n_kv_heads": 1}, {"n_kv_heads": 4, "head_dim": 8}])
def test_native_layers_give_the_eager_paths_bits(arm, batch, shape, ablate_registry, fresh_product_paths):
    """Every logit of every step equal, bit for bit, with the layers as native calls and eagerly, on
    the native product path (forced), over either kind of cache and attention, with a QKV bias and
    other head groupings; the steps of up to 16 rows ran natively, the prefills past 16 eagerly."""
    model = LlamaModel.random(preset("tiny", **shape))
    fresh_product_paths.force(NATIVE)
    eager, counts = run(ablate_registry, model, ARMS[arm], batch, native_layers=False)
    assert counts["native_layers"] == 0
    fused, counts = run(ablate_registry, model, ARMS[arm], batch)
    assert len(fused) == len(eager)
    for step, (got, want) in enumerate(zip(fused, eager)):
        assert torch.equal(got, want), f"step {step}: logits differ by up to {(got - want).abs().max():.3g}"
    # every step but the prefill (past 16 rows): the eager run chose the products' paths
    # (whether a layer's cache and attention ran inside its call as well: test_native_layer_one_call.py)
    assert (counts["native_layers"], counts["eager_layers"]) == ((len(fused) - 1) * model.config.n_layers,
                                                                  model.config.n_layers)


@pytest.mark.parametrize("why", ["products on mkl", "qk_norm", "post_norms", "gelu_tanh", "bf16", "experts"])
def test_layers_run_eagerly_where_the_native_calls_would_compute_otherwise(why, ablate_registry, fresh_product_paths):
    """The native calls compose the native products, norms, RoPE and SwiGLU: a layer whose products
    take another path, whose arithmetic has more in it, or of another dtype, runs eagerly."""
    overrides = {"qk_norm": {"qk_norm": True}, "post_norms": {"post_norms": True},
                 "gelu_tanh": {"mlp_activation": "gelu_tanh"}, "bf16": {"dtype": "bf16"},
                 "experts": {"n_experts": 4, "n_experts_per_token": 2}}.get(why, {})
    model = LlamaModel.random(preset("tiny", **overrides))
    fresh_product_paths.force(MKL if why == "products on mkl" else NATIVE)
    for m in model.modules():      # as the native path reads them: only the products' path stands in the way
        if isinstance(m, Linear):
            m.lay_out(ROW_MAJOR)
    _, counts = run(ablate_registry, model, ARMS["paged+paged"], 2)
    assert counts["native_layers"] == 0 and counts["eager_layers"] > 0


def test_the_plan_is_made_again_when_a_path_or_a_layout_changes(ablate_registry, fresh_product_paths, monkeypatch):
    """Which layers run natively is decided once and kept while nothing it depends on changes: a path
    forced anew, or a weight laid out input-major (which the native calls cannot read), sends the
    layers back to the eager path at once."""
    model = LlamaModel.random(preset("tiny"))
    fresh_product_paths.force(NATIVE)
    _, counts = run(ablate_registry, model, ARMS["paged+paged"], 1)
    assert counts["native_layers"] > 0
    fresh_product_paths.force(MKL)
    _, counts = run(ablate_registry, model, ARMS["paged+paged"], 1)
    assert counts["native_layers"] == 0
    fresh_product_paths.force(NATIVE)
    _, counts = run(ablate_registry, model, ARMS["paged+paged"], 1)
    assert counts["native_layers"] > 0
    model.layers[1].mlp.w_down.input_major()       # a layout the native calls cannot read, made between steps
    plans = []
    plan_for = NativePlans.for_step

    def native_layers(plans_, layers, x, fwd):        # per step: which layers run natively
        plan = plan_for(plans_, layers, x, fwd)
        plans.append([False] * 2 if plan is None else [n is not None for n in plan.layers])
        return plan

    monkeypatch.setattr(NativePlans, "for_step", native_layers)
    got, _ = run(ablate_registry, model, ARMS["paged+paged"], 1)
    # the prefill; the first decode step, whose plan saw the layout (the layer's eager product lays its
    # weight out row-major again, as the native path reads it); then every layer native again
    assert plans[:3] == [[False, False], [True, False], [True, True]]
    monkeypatch.undo()
    model.layers[1].mlp.w_down.input_major()
    want, _ = run(ablate_registry, model, ARMS["paged+paged"], 1, native_layers=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_native_calls_refuse_what_would_read_past_their_buffers():
    """The C code trusts its pointers: a weight, an input or a scratch of another shape, or not contiguous,
    is a ValueError naming it."""
    d, heads, kv_heads, dim, f = 16, 2, 1, 8, 24
    norm = torch.ones(d)
    weights = {"w_qkv": torch.randn((heads + 2 * kv_heads) * dim, d), "b_qkv": None,
               "w_o": torch.randn(d, heads * dim), "w_gate_up": torch.randn(2 * f, d), "w_down": torch.randn(d, f)}

    def calls(**wrong):
        w = weights | wrong
        return LayerCalls(norm, 1e-5, w["w_qkv"], w["b_qkv"], w["w_o"], norm, 1e-5, w["w_gate_up"], w["w_down"],
                          heads, kv_heads, dim, 1)

    for name, bad in (("w_qkv", weights["w_qkv"].t().contiguous().t()), ("b_qkv", torch.zeros(3)),
                      ("w_o", torch.randn(d, heads * dim + 1)), ("w_gate_up", torch.randn(2 * f + 2, d)),
                      ("w_down", torch.randn(d, f).t().contiguous().t())):
        with pytest.raises(ValueError, match=name):
            calls(**{name: bad})
    layer = calls()
    x, cos = torch.randn(3, d), torch.ones(3, 1, dim)
    scratch = torch.empty(3 * layer.scratch_floats)
    layer.check_step(x, cos, cos, scratch)
    q, k, v = (t[0] for t in layer.outputs(3))
    layer.qkv(x, cos, cos, scratch, (q, k, v))
    with pytest.raises(ValueError, match="scratch"):
        layer.check_step(x, cos, cos, scratch[:-1])
    with pytest.raises(ValueError, match="cos"):
        layer.check_step(x, torch.ones(2, 1, dim), cos, scratch)
    with pytest.raises(ValueError, match="x is"):
        layer.check_step(torch.randn(3, d + 1), cos, cos, scratch)
    with pytest.raises(ValueError, match="attn"):       # what the attention plugin returned
        layer.out_mlp(x, q[:2], scratch)


@pytest.mark.parametrize("where", ["layer", "attn", "attn.wqkv", "attn_norm", "mlp", "mlp.w_down", "every module"])
def test_every_hook_sees_its_module_run_and_no_bit_changes(where, ablate_registry, fresh_product_paths):
    """The layers are called as modules whichever path computes them: a hook on a layer sees it on
    the native path; a hook on a module inside one (a norm, the attention, a product: calibration's)
    sends that layer to the eager path, where its module is called; a global module hook, every layer.
    Each hook runs in every step, and every logit keeps its bits."""
    model = LlamaModel.random(preset("tiny"))
    fresh_product_paths.force(NATIVE)
    want, _ = run(ablate_registry, model, ARMS["paged+paged"], 1)
    seen = []
    hook = lambda module, args: seen.append(module) and None             # noqa: E731
    if where == "every module":
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(hook)]
    else:
        handles = [model.layers[1].get_submodule(where.removeprefix("layer").lstrip(".")).register_forward_pre_hook(hook)]
    try:
        got, counts = run(ablate_registry, model, ARMS["paged+paged"], 1)
    finally:
        for handle in handles:
            handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    steps, layers = len(got), model.config.n_layers
    expected_native = {"layer": (steps - 1) * layers, "every module": 0}.get(where, (steps - 1) * (layers - 1))
    assert counts["native_layers"] == expected_native
    if where != "every module":
        assert len(seen) == steps
    else:
        assert {type(m).__name__ for m in seen} >= {"DecoderLayer", "SelfAttention", "Linear", "RMSNorm", "SwiGLU"}
