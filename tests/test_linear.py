"""The CPU matmul paths of ablate.model.linear.Linear compute F.linear, whatever the layout."""
import pytest
import torch
import torch.nn.functional as F

from ablate.model import native, numpy_blas
from ablate.model.config import preset
import ablate.model.linear as linear
from ablate.model.linear import PACKABLE, Linear
from ablate.model.llama import LlamaModel


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test makes its own path choices (one-row ones included), not the process's."""
    monkeypatch.setattr(linear, "_paths", {})
    monkeypatch.setattr(numpy_blas, "on_numpy", {})


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("input_major", [False, True])
def test_linear_matches_f_linear(rows, input_major):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    want_weight = layer.weight.detach().clone()
    if input_major:
        layer.input_major()
        assert layer.weight.stride() == (1, 80) and torch.equal(layer.weight, want_weight)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, want_weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path, rows", [
    pytest.param(linear.ONEDNN, 4, marks=pytest.mark.skipif(torch.float32 not in PACKABLE, reason="no oneDNN")),
    pytest.param(linear.NATIVE, 1, marks=pytest.mark.skipif(not native.available(), reason="no native kernels")),
])
def test_packed_weight_follows_in_place_edits(path, rows):
    layer = Linear(32, 16, bias=False)
    threads = torch.get_num_threads()
    linear._paths[16, 32, torch.float32, linear.row_class(rows), threads] = path
    numpy_blas.on_numpy[torch.float32, threads] = False
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)             # bumps the version: the packed copy is stale
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach()), atol=1e-5, rtol=1e-5)


def test_loaded_model_is_input_major_and_still_tied():
    model = LlamaModel.random(preset("tiny", tied_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.stride() == (1, model.config.vocab_size)
    assert model.layers[0].attn.wqkv.weight.stride()[0] == 1


def test_bf16_model_keeps_row_major_weights():
    model = LlamaModel.random(preset("tiny", dtype="bf16"))
    assert model.layers[0].attn.wqkv.weight.is_contiguous()


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
@pytest.mark.parametrize("faster", [linear.MKL, linear.ONEDNN])
def test_the_faster_path_is_chosen_by_timing_once_and_recorded(faster, monkeypatch):
    """Whichever path the clock says is faster runs (the same product either way), chosen once per
    kind of product and listed by linear_paths()."""
    timed = []

    def fake_median(fn, repeats=7):
        timed.append(fn)
        fn()
        return 1.0 if (len(timed) % 2 == 1) == (faster == linear.ONEDNN) else 0.5   # MKL is timed first

    monkeypatch.setattr(linear, "_median_seconds", fake_median)
    layer = Linear(48, 80, bias=True)
    x = torch.randn(5, 48)
    with torch.inference_mode():
        for _ in range(3):
            got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach(), layer.bias), atol=1e-5, rtol=1e-5)
    assert len(timed) == 2                                   # timed once, then remembered
    [(kind, path)] = [(k, v) for k, v in linear.linear_paths().items() if k != "native kernels"]
    assert path == faster and kind == f"80x48 float32 2-16 rows {torch.get_num_threads()} threads"


def test_row_classes_separate_decode_verify_and_prefill():
    assert [linear.row_class_name(linear.row_class(r)) for r in (1, 2, 16, 17, 128, 129, 4096)] == [
        "1", "2-16", "2-16", "17-128", "17-128", "129+", "129+"]


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
@pytest.mark.parametrize("faster", [linear.MKL, linear.ONEDNN])
def test_the_paths_are_timed_over_every_live_layer_of_the_shape(faster, monkeypatch):
    """A decode step streams each shape's weights from every layer; one weight timed again and again
    sits in the cache. The timing runs the product through all live layers of the same shape (not
    those of another shape), and a losing oneDNN path gives back the packed copies it made. (One-row
    products are timed over every shape at once: tests/test_numpy_blas.py.)"""
    same = [Linear(48, 80, bias=False) for _ in range(3)]
    other = Linear(48, 96, bias=False)
    products = {id(m): 0 for m in [*same, other]}
    onednn = Linear._onednn

    def counted(self, x):
        products[id(self)] += 1
        return onednn(self, x)

    monkeypatch.setattr(Linear, "_onednn", counted)
    timings = iter([0.5, 1.0] if faster == linear.MKL else [1.0, 0.5])     # MKL is timed first
    monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (fn(), next(timings))[1])
    x = torch.randn(4, 48)
    with torch.inference_mode():
        got = same[0](x)
    torch.testing.assert_close(got, F.linear(x, same[0].weight.detach()), atol=1e-5, rtol=1e-5)
    assert [products[id(m)] for m in same] == [1 + (faster == linear.ONEDNN), 1, 1] and products[id(other)] == 0
    assert all((m._packed is None) == (faster == linear.MKL) for m in same)


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
def test_products_of_many_rows_are_timed_on_one_layer(monkeypatch):
    """Past 16 rows a product reuses its weight across rows: timing it over every layer would only cost
    time (minutes for a large prefill), so one layer times it."""
    layers = [Linear(48, 80, bias=False) for _ in range(3)]
    calls = []
    monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (calls.append(len(fn())), 1.0)[1])
    with torch.inference_mode():
        layers[0](torch.randn(17, 48))
    assert calls == [1, 1]


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
def test_a_losing_onednn_path_keeps_the_packed_copies_other_row_classes_use(monkeypatch):
    layers = [Linear(48, 80, bias=False) for _ in range(2)]
    with torch.inference_mode():
        layers[1]._onednn(torch.randn(20, 48))           # packed for a 17-128-row product, before any timing
        timings = iter([0.5, 1.0])                         # MKL wins the 2-16-row timing
        monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (fn(), next(timings))[1])
        layers[0](torch.randn(2, 48))
    assert layers[0]._packed is None and layers[1]._packed is not None
