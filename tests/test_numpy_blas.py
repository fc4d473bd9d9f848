"""One-row products on numpy's BLAS (ablate/model/linear.py, ablate/model/numpy_blas.py): chosen by
timing every shape at once, on the layout they are fastest on (the weights laid out so, in place), and run in steps that lend numpy the cores
(PRODUCT_PATHS.one_row_step)."""
import pytest
import torch
import torch.nn.functional as F

import ablate.model.linear as linear
import ablate.model.path_timing as path_timing
from ablate.model import native, numpy_blas
from ablate.model.linear import PACKABLE, Linear
from ablate.model.product_paths import MKL, NATIVE, NUMPY, PRODUCT_PATHS

pytestmark = [       # the tests run torch on one thread (conftest.py): numpy's BLAS too, where nothing spins
    pytest.mark.skipif(torch.float32 not in PACKABLE or numpy_blas.unavailable_reason(1) is not None,
                       reason=f"oneDNN cannot pack on this CPU, or {numpy_blas.unavailable_reason(1)}"),
    # choices made afresh, among the layers a test makes (not every Linear alive in the process)
    pytest.mark.usefixtures("fresh_product_paths")]


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: each timing costs what `costs` says for the path and layout it ran (mkl-row-major,
    mkl-input-major, numpy-row-major, numpy-input-major, native: slowest unless a test says
    otherwise; "<that> in a step" where small operations ran between the products, if it says);
    `products` counts the products run on each."""
    costs, ran, products, between = {}, [], {}, []
    run = Linear._run

    def counted(self, path, x, threads):
        name = path if path == "native" else f"{path}-{linear.layout_of(self.weight)}"
        ran.append(name)
        products[name] = products.get(name, 0) + 1
        return run(self, path, x, threads)

    monkeypatch.setattr(Linear, "_run", counted)

    def median(fn, repeats=7):
        ran.clear(), between.clear()
        fn()
        return costs.get(ran[0] + " in a step" if between else ran[0], costs.get(ran[0], 10.0))

    monkeypatch.setattr(path_timing, "median_seconds", median)
    monkeypatch.setattr(path_timing.F, "rms_norm", lambda *args, **kwargs: between.append(args[0].shape))
    monkeypatch.setattr(path_timing.time, "sleep", lambda s: None)
    return costs, products


def layers_of_two_shapes():
    torch.manual_seed(0)
    return [Linear(48, 80, bias=True) for _ in range(2)] + [Linear(80, 48, bias=False)]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("input_major", [False, True])
def test_the_numpy_path_computes_f_linear_on_the_weight_in_place(rows, input_major):
    layer = Linear(48, 80, bias=True)
    if input_major:
        layer.input_major()
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        got = layer._numpy(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach(), layer.bias), atol=1e-5, rtol=1e-5)
    assert torch.from_numpy(layer._numpy_wt).data_ptr() == layer.weight.data_ptr()     # a view, not a copy


def test_numpy_wins_every_one_row_product_when_its_total_is_faster(clock):
    """numpy faster in total (though slower than MKL on one layout): every one-row product of a step
    goes to it, each shape held in the layout numpy was fastest on; outside such a step torch's
    fastest path on that layout runs."""
    costs, products = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 0.5, "numpy-row-major": 0.45, "numpy-input-major": 0.4})
    layers = layers_of_two_shapes()
    threads = torch.get_num_threads()
    x = torch.randn(1, 48)
    with torch.inference_mode():
        layers[0](x)                               # the first one-row product: every shape is timed
        assert PRODUCT_PATHS.lends_one_row(torch.float32, threads)
        assert PRODUCT_PATHS.choices() == {f"80x48 float32 1 rows {threads} threads": "mkl",
                                           f"48x80 float32 1 rows {threads} threads": "mkl",
                                           "80x48 float32 weights": "input-major",
                                           "48x80 float32 weights": "input-major",
                                           f"one-row steps float32 {threads} threads": "numpy",
                                           "native kernels": native.state(),
                                           "cpu_products": "auto"}
        assert all(linear.layout_of(m.weight) == "input-major" for m in layers)
        products.clear()
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            assert torch.get_num_threads() == 1    # torch's own operations on the calling thread
            got = layers[2](layers[0](x))
        assert torch.get_num_threads() == threads
        assert products == {}                      # lent: straight to numpy, not through _run
        torch.testing.assert_close(got, F.linear(F.linear(x, layers[0].weight, layers[0].bias), layers[2].weight),
                                   atol=1e-5, rtol=1e-5)
        with PRODUCT_PATHS.one_row_step(4, layers[0].weight):   # not a one-row step: nothing lent
            assert torch.get_num_threads() == threads
        layers[0](x)                               # a one-row product outside such a step: torch's path
        assert products == {"mkl-input-major": 1}


def test_numpy_is_judged_with_a_steps_operations_between_its_products(clock):
    """Back to back numpy's BLAS is the faster, but with the small operations a step runs between two
    products (its lent pool waking for each) it is slower: one-row steps stay on torch's paths, each
    shape on the path and layout torch was fastest on."""
    costs, _ = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 0.5, "numpy-row-major": 0.45, "numpy-input-major": 0.4,
                  "numpy-row-major in a step": 1.5, "numpy-input-major in a step": 1.4,
                  "mkl-input-major in a step": 0.6})
    layers = layers_of_two_shapes()
    threads = torch.get_num_threads()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
    assert not PRODUCT_PATHS.lends_one_row(torch.float32, threads)
    assert PRODUCT_PATHS.path_for((80, 48, torch.float32, 0, threads)) == MKL
    assert all(linear.layout_of(m.weight) == "input-major" for m in layers)


@pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("in_layers", [True, False])
def test_native_layers_are_judged_with_their_products_back_to_back(clock, in_layers):
    """With a step's operations between them the native kernel loses to numpy's BLAS, lent the cores; but
    the products of layers that run as native calls (ablate/model/native/layers.py) have no Python
    between them, so their back-to-back time is what a step spends. Where every layer of the shapes is
    such a layer, one-row steps take the native kernel for every shape ("native layers"), the weights
    row-major for it; where none is, the operations count and numpy wins."""
    costs, _ = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 0.9, "numpy-row-major": 0.45, "numpy-input-major": 0.5,
                  "numpy-row-major in a step": 0.7, "numpy-input-major in a step": 0.8,
                  "mkl-input-major in a step": 1.1, "native": 0.6, "native in a step": 0.9})
    layers = layers_of_two_shapes()
    for m in layers:
        m.in_native_layer = in_layers
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
    threads = torch.get_num_threads()
    way = PRODUCT_PATHS.choices()[f"one-row steps float32 {threads} threads"]
    assert way == ("native layers" if in_layers else NUMPY)
    if in_layers:
        assert not PRODUCT_PATHS.lends_one_row(torch.float32, threads)
        assert {PRODUCT_PATHS.path_for((*m.weight.shape, torch.float32, 0, threads)) for m in layers} == {NATIVE}
        assert all(m.weight.is_contiguous() for m in layers)


def test_torch_keeps_one_row_products_when_numpy_is_slower_in_total(clock):
    costs, products = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 0.3, "numpy-row-major": 0.5, "numpy-input-major": 0.4})
    layers = layers_of_two_shapes()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
        assert not PRODUCT_PATHS.lends_one_row(torch.float32, torch.get_num_threads())
        assert linear.copy_bytes(layers[0]) == 0 and all(m._packed is None for m in layers)
        threads = torch.get_num_threads()
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            assert torch.get_num_threads() == threads
            products.clear()
            layers[0](torch.randn(1, 48))
        assert products == {"mkl-input-major": 1}


def test_numpy_keeps_the_layout_it_is_fastest_on_with_no_copy(clock):
    """Where numpy is fastest on row-major W, the weights themselves are laid out so (in place: numpy's
    array is a view of the weight, not a copy beside it)."""
    costs, _ = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 1.0, "numpy-input-major": 0.5, "numpy-row-major": 0.2})
    layers = layers_of_two_shapes()
    for m in layers:
        m.input_major()
    with torch.inference_mode():
        layers[0](torch.randn(1, 48))
        with PRODUCT_PATHS.one_row_step(1, layers[0].weight):
            layers[0](torch.randn(1, 48))
    assert all(m.weight.is_contiguous() for m in layers)
    assert torch.from_numpy(layers[0]._numpy_wt).data_ptr() == layers[0].weight.data_ptr()


def test_no_numpy_without_a_blas_to_bind(clock, monkeypatch):
    """Without threadpoolctl (or a BLAS it knows) numpy's thread count cannot follow torch's: not timed."""
    costs, products = clock
    costs.update({"mkl-row-major": 1.0, "mkl-input-major": 1.0, "numpy-row-major": 0.1, "numpy-input-major": 0.1})
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
