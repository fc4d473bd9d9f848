"""One-row products on numpy's BLAS (ablate/model/linear.py, ablate/model/numpy_blas.py): chosen by
timing every shape at once, on the faster layout, and run in steps that lend numpy the cores
(PRODUCT_PATHS.one_row_step)."""
import pytest
import torch
import torch.nn.functional as F

import ablate.model.linear as linear
from ablate.model import native, numpy_blas
from ablate.model.linear import PACKABLE, Linear
from ablate.model.product_paths import MKL, NUMPY, PRODUCT_PATHS

pytestmark = [       # the tests run torch on one thread (conftest.py): numpy's BLAS too, where nothing spins
    pytest.mark.skipif(torch.float32 not in PACKABLE or numpy_blas.unavailable_reason(1) is not None,
                       reason=f"oneDNN cannot pack on this CPU, or {numpy_blas.unavailable_reason(1)}"),
    # choices made afresh, among the layers a test makes (not every Linear alive in the process)
    pytest.mark.usefixtures("fresh_product_paths")]


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: each timing costs what `costs` says for the path it ran (mkl, onednn,
    numpy-stored, numpy-rows, native: slowest unless a test says otherwise); `products` counts the
    products run on each path."""
    costs, ran, products = {"native": 10.0}, [], {}
    onednn, numpy, matvec = Linear._onednn, Linear._numpy, native.matvec

    def count(name: str) -> None:
        ran.append(name)
        products[name] = products.get(name, 0) + 1

    def counted(path, method):
        def run(self, x):
            count(path(self))
            return method(self, x)
        return run

    monkeypatch.setattr(Linear, "_onednn", counted(lambda self: "onednn", onednn))
    monkeypatch.setattr(Linear, "_numpy", counted(lambda self: "numpy-rows" if self._numpy_rows else "numpy-stored", numpy))
    monkeypatch.setattr(native, "matvec", lambda *args: count("native") or matvec(*args))

    def median(fn, repeats=7):
        ran.clear()
        fn()
        return costs[ran[0] if ran else "mkl"]

    monkeypatch.setattr(linear, "_median_seconds", median)
    monkeypatch.setattr(linear.time, "sleep", lambda s: None)
    return costs, products


def layers_of_two_shapes():
    torch.manual_seed(0)
    return [Linear(48, 80, bias=True) for _ in range(2)] + [Linear(80, 48, bias=False)]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("row_major", [False, True])
@pytest.mark.parametrize("input_major", [False, True])
def test_the_numpy_path_computes_f_linear(rows, row_major, input_major):
    layer = Linear(48, 80, bias=True)
    if input_major:
        layer.input_major()
    layer._numpy_rows = row_major
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got = layer._numpy(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach(), layer.bias), atol=1e-5, rtol=1e-5)
    on_weight = torch.from_numpy(layer._numpy_wt).data_ptr() == layer.weight.data_ptr()
    assert on_weight == (not (row_major and input_major))      # a copy only where the layout differs


def test_numpy_wins_every_one_row_product_when_its_total_is_faster(clock):
    """numpy faster in total (though slower than oneDNN on one shape): every one-row product of a
    step goes to it, on each shape's faster layout; outside such a step torch's choices stand."""
    costs, products = clock
    costs.update({"mkl": 1.0, "onednn": 0.5, "numpy-stored": 0.4, "numpy-rows": 0.45})
    layers = layers_of_two_shapes()
    threads = torch.get_num_threads()
    x = torch.randn(1, 48)
    with torch.inference_mode():
        layers[0](x)                               # the first one-row product: every shape is timed
        assert PRODUCT_PATHS.lends_one_row(torch.float32, threads)
        assert PRODUCT_PATHS.choices() == {f"80x48 float32 1 rows {threads} threads": "onednn",
                                           f"48x80 float32 1 rows {threads} threads": "onednn",
                                           f"one-row steps float32 {threads} threads": "numpy",
                                           "native kernels": native.unavailable_reason() or "built",
                                           "cpu_products": "auto"}
        products.clear()
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            assert torch.get_num_threads() == 1    # torch's own operations on the calling thread
            got = layers[2](layers[0](x))
        assert torch.get_num_threads() == threads
        assert products == {"numpy-stored": 2}
        torch.testing.assert_close(got, F.linear(F.linear(x, layers[0].weight, layers[0].bias), layers[2].weight),
                                   atol=1e-5, rtol=1e-5)
        products.clear()
        with PRODUCT_PATHS.one_row_step(4, layers[0].weight):   # not a one-row step: nothing lent
            assert torch.get_num_threads() == threads
        layers[0](x)                               # a one-row product outside such a step: torch's path
        assert products == {"onednn": 1}


def test_torch_keeps_one_row_products_when_numpy_is_slower_in_total(clock):
    costs, products = clock
    costs.update({"mkl": 1.0, "onednn": 0.3, "numpy-stored": 0.4, "numpy-rows": 0.5})
    layers = layers_of_two_shapes()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
        assert not PRODUCT_PATHS.lends_one_row(torch.float32, torch.get_num_threads())
        assert all(m._numpy_wt is None for m in layers)         # numpy's arrays given back
        assert all(m._native_packed is None for m in layers)    # and the losing native kernel's copies
        threads = torch.get_num_threads()
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            assert torch.get_num_threads() == threads
            products.clear()
            layers[0](torch.randn(1, 48))
        assert products == {"onednn": 1}


def test_numpy_keeps_the_faster_layout(clock):
    """A row-major copy where it wins (a copy: it does not share W's memory), W as stored where that wins."""
    costs, _ = clock
    costs.update({"mkl": 1.0, "onednn": 1.0, "numpy-stored": 0.5, "numpy-rows": 0.2})
    layers = layers_of_two_shapes()
    for m in layers:
        m.input_major()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            layers[0](torch.randn(1, 48))
    assert layers[0]._numpy_rows and layers[2]._numpy_rows
    assert torch.from_numpy(layers[0]._numpy_wt).data_ptr() != layers[0].weight.data_ptr()   # the copy


def test_no_numpy_without_a_blas_to_bind(clock, monkeypatch):
    """Without threadpoolctl (or a BLAS it knows) numpy's thread count cannot follow torch's: not timed."""
    costs, products = clock
    costs.update({"mkl": 1.0, "onednn": 1.0, "numpy-stored": 0.1, "numpy-rows": 0.1})
    monkeypatch.setattr(numpy_blas, "_blas", False)
    layers = layers_of_two_shapes()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
    assert PRODUCT_PATHS.choices()[f"one-row steps float32 {torch.get_num_threads()} threads"] == "torch"
    assert not any(name.startswith("numpy") for name in products)


def test_a_batch_1_decode_step_runs_its_products_on_numpy(ablate_registry, monkeypatch):
    """Through the engine (KV cache on: one token a decode step): with numpy forced (cpu_products=numpy),
    every product of a one-token step runs on it with torch on one thread (the prefill keeps torch's
    paths and threads), and the greedy tokens are those of torch's paths."""
    from ablate.api.context import EngineConfig
    from ablate.api.sequence import Request
    from ablate.model.presets import preset
    from ablate.model.llama import LlamaModel
    from ablate.testing.scenarios import build

    model = LlamaModel.random(preset("tiny"))
    threads = torch.get_num_threads()

    def tokens() -> list[int]:
        built = build(ablate_registry, {"kv_cache": "contiguous", "attention": "sdpa"}, model, EngineConfig(), 64)
        try:
            return built.engine.run([Request(0, tuple(range(3, 19)), 12)])[0].output_token_ids
        finally:
            built.close()

    PRODUCT_PATHS.force(MKL)
    want = tokens()
    PRODUCT_PATHS.force(NUMPY)
    lent = []
    numpy = Linear._numpy
    monkeypatch.setattr(Linear, "_numpy", lambda self, x: lent.append(torch.get_num_threads()) or numpy(self, x))
    assert tokens() == want
    products_per_step = sum(isinstance(m, Linear) for m in model.modules())
    assert len(lent) == 11 * products_per_step and set(lent) == {1}     # 11 decode steps after the prefill
    assert torch.get_num_threads() == threads
    assert PRODUCT_PATHS.choices()[f"one-row steps float32 {threads} threads"] == NUMPY
