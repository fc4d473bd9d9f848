"""The CPU matmul paths of ablate.model.linear.Linear compute F.linear, whatever the layout; each
kind of product takes the path timed fastest or the one forced (ablate.model.product_paths)."""
import pytest
import torch
import torch.nn.functional as F

from ablate.model import native
from ablate.model.presets import preset
import ablate.model.linear as linear
from ablate.model.linear import PACKABLE, Linear
from ablate.model.llama import LlamaModel
from ablate.model.product_paths import MKL, NATIVE, ONEDNN, PRODUCT_PATHS, row_class, row_class_name

# each test makes its own path choices (one-row ones included) among its own layers, not the process's
pytestmark = pytest.mark.usefixtures("fresh_product_paths")


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
    pytest.param(ONEDNN, 4, marks=pytest.mark.skipif(torch.float32 not in PACKABLE, reason="no oneDNN")),
    pytest.param(NATIVE, 1, marks=pytest.mark.skipif(not native.available(), reason="no native kernels")),
])
def test_packed_weight_follows_in_place_edits(path, rows):
    layer = Linear(32, 16, bias=False)
    PRODUCT_PATHS.force({row_class_name(row_class(rows)): path})
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
@pytest.mark.parametrize("faster", [MKL, ONEDNN])
def test_the_faster_path_is_chosen_by_timing_once_and_recorded(faster, monkeypatch):
    """Whichever path the clock says is faster runs (the same product either way), chosen once per
    kind of product and listed by PRODUCT_PATHS.choices()."""
    timed = []

    def fake_median(fn, repeats=7):
        timed.append(fn)
        fn()
        return 1.0 if (len(timed) % 2 == 1) == (faster == ONEDNN) else 0.5   # MKL is timed first

    monkeypatch.setattr(linear, "_median_seconds", fake_median)
    layer = Linear(48, 80, bias=True)
    x = torch.randn(5, 48)
    with torch.inference_mode():
        for _ in range(3):
            got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach(), layer.bias), atol=1e-5, rtol=1e-5)
    assert len(timed) == 2                                   # timed once, then remembered
    [(kind, path)] = [(k, v) for k, v in PRODUCT_PATHS.choices().items()
                      if k not in ("native kernels", "cpu_products")]
    assert path == faster and kind == f"80x48 float32 2-16 rows {torch.get_num_threads()} threads"
    assert PRODUCT_PATHS.choices()["cpu_products"] == "auto"


def test_row_classes_separate_decode_verify_and_prefill():
    assert [row_class_name(row_class(r)) for r in (1, 2, 16, 17, 128, 129, 4096)] == [
        "1", "2-16", "2-16", "17-128", "17-128", "129+", "129+"]


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
@pytest.mark.parametrize("faster", [MKL, ONEDNN])
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
    timings = iter([0.5, 1.0] if faster == MKL else [1.0, 0.5])     # MKL is timed first
    monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (fn(), next(timings))[1])
    x = torch.randn(4, 48)
    with torch.inference_mode():
        got = same[0](x)
    torch.testing.assert_close(got, F.linear(x, same[0].weight.detach()), atol=1e-5, rtol=1e-5)
    assert [products[id(m)] for m in same] == [1 + (faster == ONEDNN), 1, 1] and products[id(other)] == 0
    assert all((m._packed is None) == (faster == MKL) for m in same)


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


# -- forcing and forgetting the choices (PRODUCT_PATHS.force, reset) ---------------------------------

class CountedPaths:
    """Counts the products each path runs: oneDNN, the native kernel and numpy through Linear's own
    methods; MKL is what runs through F.linear with none of them."""

    def __init__(self, monkeypatch):
        self.ran: list[str] = []
        for name in ("onednn", "native", "numpy"):
            method = getattr(Linear, f"_{name}")
            monkeypatch.setattr(Linear, f"_{name}",
                                lambda layer, *args, name=name, method=method: self.ran.append(name) or method(layer, *args))


def products(model, rows: int) -> int:
    """Every Linear of `model` once on `rows` rows (its products as a forward pass runs them): how many ran."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    with torch.inference_mode():
        for m in layers:
            torch.testing.assert_close(m(x := torch.randn(rows, m.in_features)), F.linear(x, m.weight, m.bias),
                                       atol=1e-4, rtol=1e-4)
    return len(layers)


@pytest.mark.parametrize("path, rows", [
    (MKL, (1, 5, 40, 200)),
    pytest.param(ONEDNN, (1, 5, 40, 200), marks=pytest.mark.skipif(torch.float32 not in PACKABLE, reason="no oneDNN")),
    pytest.param(NATIVE, (1,), marks=pytest.mark.skipif(not native.available(), reason="no native kernels")),
])
def test_a_forced_path_takes_every_product_of_a_model_untimed(path, rows, monkeypatch):
    """cpu_products=<path>: every product of a tiny random model the path can take (every row class;
    the native kernel: one row) runs on it, the same product as F.linear, and nothing is timed."""
    model = LlamaModel.random(preset("tiny"))
    counted, timings = CountedPaths(monkeypatch), PRODUCT_PATHS.timings
    PRODUCT_PATHS.force(path)
    ran = sum(products(model, r) for r in rows)
    assert counted.ran == ([] if path == MKL else [path] * ran)
    assert PRODUCT_PATHS.timings == timings
    choices = PRODUCT_PATHS.choices()
    assert choices["cpu_products"] == path
    assert {v for k, v in choices.items() if " rows " in k} == {path}
    if 1 in rows:                                  # one-row steps stay on torch's side: not lent to numpy
        assert choices[f"one-row steps float32 {torch.get_num_threads()} threads"] == "torch"


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
def test_reset_makes_the_next_product_time_again(monkeypatch):
    layer = Linear(48, 80, bias=False)
    monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (fn(), 1.0)[1])
    x = torch.randn(5, 48)
    with torch.inference_mode():
        layer(x)
        timed = PRODUCT_PATHS.timings
        layer(x)
        assert PRODUCT_PATHS.timings == timed                # remembered
        PRODUCT_PATHS.reset()
        assert not [k for k in PRODUCT_PATHS.choices() if " rows " in k]
        layer(x)
        assert PRODUCT_PATHS.timings == timed + 1            # timed again
        PRODUCT_PATHS.force(MKL)                             # a forced class forgets its timed choice
        layer(x)
        assert PRODUCT_PATHS.timings == timed + 1
        PRODUCT_PATHS.reset()                                # and reset forgets the forcing
        layer(x)
        assert PRODUCT_PATHS.timings == timed + 2 and PRODUCT_PATHS.setting == "auto"


@pytest.mark.skipif(torch.float32 not in PACKABLE, reason="oneDNN cannot pack on this CPU")
def test_forcing_one_row_class_leaves_the_others_timed(monkeypatch):
    monkeypatch.setattr(linear, "_median_seconds", lambda fn, repeats=7: (fn(), 1.0)[1])
    layer = Linear(48, 80, bias=False)
    with torch.inference_mode():
        layer(torch.randn(40, 48))                           # 17-128 rows: timed
        PRODUCT_PATHS.force({"2-16": ONEDNN})
        timed = PRODUCT_PATHS.timings
        layer(torch.randn(40, 48))
        layer(torch.randn(3, 48))
    threads = torch.get_num_threads()
    assert PRODUCT_PATHS.timings == timed                    # the 17-128 choice stood; 2-16 was forced
    assert PRODUCT_PATHS.choices()[f"80x48 float32 2-16 rows {threads} threads"] == ONEDNN
    assert PRODUCT_PATHS.setting == "2-16 rows: onednn"
    with PRODUCT_PATHS.forced(MKL):                          # for a block (a job), then back
        assert PRODUCT_PATHS.setting == "mkl"
    assert PRODUCT_PATHS.setting == "2-16 rows: onednn"


@pytest.mark.parametrize("how, message", [
    ("fast", "cpu_products must be one of auto, mkl, onednn, numpy, native, got 'fast'"),
    ({"2-17": MKL}, "no row class '2-17': the row classes are 1, 2-16, 17-128, 129+"),
    ({"1": "blas"}, "row class 1: no path 'blas'; the paths are mkl, onednn, numpy, native"),
    ({"2-16": NATIVE}, "row class 2-16: native takes one-row products only (row class 1)"),
])
def test_forcing_refuses_what_is_not_a_path_in_one_message(how, message):
    with pytest.raises(ValueError) as refused:
        PRODUCT_PATHS.force(how)
    assert str(refused.value) == message
    assert PRODUCT_PATHS.setting == "auto"


def test_forcing_a_path_that_cannot_run_here_says_why():
    with PRODUCT_PATHS.without_native("no compiler here"):
        with pytest.raises(ValueError, match=r"^cpu_products=native: native cannot run here: no native kernels "
                                             r"\(no compiler here\)$"):
            PRODUCT_PATHS.force(NATIVE)
    assert PRODUCT_PATHS.setting == "auto"


# -- cpu_products: the config field, applied at the job's start and recorded with the run ------------

SMALL_JOB = ["wandb.mode=disabled", "experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2",
             "workload.prompt_len=8", "workload.output_len=4"]


def test_cpu_products_refuses_a_bad_value_in_one_message(tmp_path, compose_config, registry):
    from ablate.experiment.config import to_run_config

    with pytest.raises(ValueError) as refused:
        to_run_config(compose_config(tmp_path, "cpu_products=fastest"), registry)
    assert str(refused.value) == "cpu_products must be one of auto, mkl, onednn, numpy, native, got 'fastest'"


def test_the_cli_says_a_bad_cpu_products_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ablate", "cpu_products=fastest", "device=cpu",
                           f"results_dir={tmp_path}", "wandb.mode=disabled"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: cpu_products must be one of auto, mkl, onednn, numpy, native, got 'fastest'"


def test_a_jobs_cpu_products_is_applied_and_recorded_in_environment_json(tmp_path, compose_config, registry):
    """cpu_products=mkl: every product of the run on MKL, untimed; environment.json lists the choices
    (each kind of product, the setting) and the process's environment settings; after the job the
    process's products are timed again (a sweep's next job in this process)."""
    import json

    from ablate.experiment.job import run_job

    raw = compose_config(tmp_path, "model=tiny", "cpu_products=mkl", *SMALL_JOB)
    timings = PRODUCT_PATHS.timings
    folder = run_job(raw, registry)
    env = json.loads((folder.path / "environment.json").read_text())
    choices = env["linear_paths"]
    kinds = {k: v for k, v in choices.items() if " rows " in k}
    assert kinds and set(kinds.values()) == {MKL} and choices["cpu_products"] == MKL
    assert {"1", "2-16"} <= {k.split()[2] for k in kinds}          # decode steps and the prompts' products
    assert PRODUCT_PATHS.timings == timings                         # forced: nothing timed
    assert set(env["process_env"]) >= {"THP_MEM_ALLOC_ENABLE", "OPENBLAS_THREAD_TIMEOUT", "numpy_spin_bounded"}
    assert json.loads((folder.path / "config.json").read_text())["cpu_products"] == MKL
    assert PRODUCT_PATHS.setting == "auto"
