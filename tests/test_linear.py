"""The CPU matmul paths of ablate.model.linear.Linear compute F.linear, whatever the layout; each
kind of product takes the path timed fastest or the one forced (ablate.model.product_paths)."""
import pytest
import torch
import torch.nn.functional as F

from ablate.model import native, numpy_blas
from ablate.model.presets import preset
import ablate.model.linear as linear
import ablate.model.path_timing as path_timing
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
def test_a_path_follows_in_place_edits_of_the_weight(path, rows):
    layer = Linear(32, 16, bias=False)
    PRODUCT_PATHS.force({row_class_name(row_class(rows)): path})
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)             # bumps the version: a packed copy is stale
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight.detach()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", [MKL, "auto",
                                  pytest.param(ONEDNN, marks=pytest.mark.skipif(torch.float32 not in PACKABLE,
                                                                                reason="no oneDNN")),
                                  pytest.param(NATIVE, marks=pytest.mark.skipif(not native.available(),
                                                                                reason="no native kernels")),
                                  pytest.param("numpy", marks=pytest.mark.skipif(
                                      numpy_blas.unavailable_reason(1) is not None, reason="no BLAS to bind"))])
@pytest.mark.parametrize("shape", [(0, 48), (2, 0, 48)])
def test_a_product_of_no_rows_is_empty_on_every_path(path, shape):
    """A step whose sequences need no logits (a chunk of a prompt) hands the head no rows: whatever
    path its kind took, the product is an empty tensor of the right shape, not an error."""
    layer = Linear(48, 80, bias=True)
    PRODUCT_PATHS.force(path)
    with torch.inference_mode():
        layer(torch.randn(1, 48))                        # the one-row kind is settled first
        got = layer(torch.randn(*shape))
    assert got.shape == (*shape[:-1], 80)


def test_loaded_model_is_input_major_and_still_tied():
    model = LlamaModel.random(preset("tiny", tied_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.stride() == (1, model.config.vocab_size)
    assert model.layers[0].attn.wqkv.weight.stride()[0] == 1


def test_bf16_model_keeps_row_major_weights():
    model = LlamaModel.random(preset("tiny", dtype="bf16"))
    assert model.layers[0].attn.wqkv.weight.is_contiguous()


STREAMED_PAIRS = path_timing.candidates(torch.float32, 1, None)     # (layout, path): the order they are timed in


def clock_favouring(pair, order, timed=None):
    """A stand-in for path_timing.median_seconds: 0.5 s for `pair`'s turn in `order`, 1 s for the others."""
    turn = iter(range(10_000))

    def fake_median(fn, repeats=7):
        if timed is not None:
            timed.append(fn)
        fn()
        return 0.5 if order[next(turn) % len(order)] == pair else 1.0
    return fake_median


@pytest.mark.parametrize("faster", STREAMED_PAIRS, ids=[f"{layout} {path}" for layout, path in STREAMED_PAIRS])
def test_the_faster_path_and_layout_are_chosen_by_timing_once_and_recorded(faster, monkeypatch):
    """Whichever (layout, path) the clock says is faster runs (the same product either way), chosen once
    per kind of product, the weight held in that layout and both listed by PRODUCT_PATHS.choices()."""
    timed = []
    monkeypatch.setattr(path_timing, "median_seconds", clock_favouring(faster, STREAMED_PAIRS, timed))
    layer = Linear(48, 80, bias=True)
    layer.input_major()
    want = layer.weight.detach().clone()
    x = torch.randn(5, 48)
    with torch.inference_mode():
        for _ in range(3):
            got = layer(x)
    torch.testing.assert_close(got, F.linear(x, want, layer.bias), atol=1e-5, rtol=1e-5)
    assert len(timed) == len(STREAMED_PAIRS)                 # timed once, then remembered
    assert torch.equal(layer.weight, want) and linear.layout_of(layer.weight) == faster[0]
    kinds = {k: v for k, v in PRODUCT_PATHS.choices().items() if k not in ("native kernels", "cpu_products")}
    assert kinds == {f"80x48 float32 2-16 rows {torch.get_num_threads()} threads": faster[1],
                     "80x48 float32 weights": faster[0]}
    assert PRODUCT_PATHS.choices()["cpu_products"] == "auto"
    assert linear.copy_bytes(layer) == 0                     # no path of fp32 under auto keeps a copy


def test_a_shapes_layout_is_settled_once_and_later_kinds_choose_among_its_paths(monkeypatch):
    """The first streamed kind of a shape settles its layout; a later one (a 2-16-row verify pass after
    one-row decode steps) is timed only on the paths that read the weights where they lie."""
    input_major = [pair for pair in STREAMED_PAIRS if pair[0] == linear.INPUT_MAJOR]
    monkeypatch.setattr(path_timing, "median_seconds", clock_favouring(input_major[0], STREAMED_PAIRS))
    layers = [Linear(48, 80, bias=False) for _ in range(2)]
    with torch.inference_mode():
        layers[0](torch.randn(3, 48))
    assert all(linear.layout_of(m.weight) == linear.INPUT_MAJOR for m in layers)
    assert path_timing.candidates(torch.float32, 0, PRODUCT_PATHS.layout_for((80, 48, torch.float32))) == input_major


def test_row_classes_separate_decode_verify_and_prefill():
    assert [row_class_name(row_class(r)) for r in (1, 2, 16, 17, 128, 129, 4096)] == [
        "1", "2-16", "2-16", "17-128", "17-128", "129+", "129+"]


@pytest.mark.parametrize("faster", STREAMED_PAIRS, ids=[f"{layout} {path}" for layout, path in STREAMED_PAIRS])
def test_the_paths_are_timed_over_every_live_layer_of_the_shape(faster, monkeypatch):
    """A decode step streams each shape's weights from every layer; one weight timed again and again
    sits in the cache. The timing runs the product through all live layers of the same shape (not
    those of another shape), and leaves every one of them in the layout that won. (One-row products
    are timed over every shape at once: tests/test_numpy_blas.py.)"""
    same = [Linear(48, 80, bias=False) for _ in range(3)]
    other = Linear(48, 96, bias=False)
    products = {id(m): 0 for m in [*same, other]}
    run = Linear._run
    monkeypatch.setattr(Linear, "_run", lambda self, *args: products.__setitem__(id(self), products[id(self)] + 1)
                        or run(self, *args))
    monkeypatch.setattr(path_timing, "median_seconds", clock_favouring(faster, STREAMED_PAIRS))
    x = torch.randn(4, 48)
    with torch.inference_mode():
        got = same[0](x)
    torch.testing.assert_close(got, F.linear(x, same[0].weight.detach()), atol=1e-5, rtol=1e-5)
    timed = len(STREAMED_PAIRS)
    assert [products[id(m)] for m in same] == [timed + 1, timed, timed] and products[id(other)] == 0
    assert all(linear.layout_of(m.weight) == faster[0] for m in same)
    assert linear.layout_of(other.weight) == linear.ROW_MAJOR and all(m._packed is None for m in same)


def test_fp32_products_of_many_rows_take_mkl_on_the_layout_held_untimed():
    """Past 16 rows a product reuses its weight across rows (compute-bound): MKL reads either layout
    at its best, and no other path is worth a copy of W, so nothing is timed or copied."""
    layers = [Linear(48, 80, bias=False) for _ in range(3)]
    layers[0].input_major()
    timings = PRODUCT_PATHS.timings
    with torch.inference_mode():
        for m in layers:
            m(torch.randn(17, 48))
    assert PRODUCT_PATHS.timings == timings
    assert PRODUCT_PATHS.choices()[f"80x48 float32 17-128 rows {torch.get_num_threads()} threads"] == MKL
    assert linear.layout_of(layers[0].weight) == linear.INPUT_MAJOR and linear.layout_of(layers[1].weight) == linear.ROW_MAJOR


@pytest.mark.skipif(torch.bfloat16 not in PACKABLE, reason="oneDNN cannot pack bf16 on this CPU")
def test_bf16_products_of_many_rows_are_timed_on_one_layer(monkeypatch):
    """bf16 times MKL against oneDNN's copy (its bf16 units read the blocked layout): past 16 rows on
    one layer, since timing every layer would only cost time (minutes for a large prefill)."""
    layers = [Linear(48, 80, bias=False, dtype=torch.bfloat16) for _ in range(3)]
    calls = []
    monkeypatch.setattr(path_timing, "median_seconds", lambda fn, repeats=7: (calls.append(len(fn())), 1.0)[1])
    with torch.inference_mode():
        layers[0](torch.randn(17, 48, dtype=torch.bfloat16))
    assert calls == [1, 1]


@pytest.mark.skipif(torch.bfloat16 not in PACKABLE, reason="oneDNN cannot pack bf16 on this CPU")
def test_a_losing_onednn_path_keeps_the_packed_copies_other_row_classes_use(monkeypatch):
    layer = Linear(48, 80, bias=False, dtype=torch.bfloat16)
    monkeypatch.setattr(path_timing, "median_seconds", clock_favouring((linear.ROW_MAJOR, MKL), [
        (linear.ROW_MAJOR, MKL), (linear.ROW_MAJOR, ONEDNN)]))
    with torch.inference_mode():
        PRODUCT_PATHS.force({"2-16": ONEDNN})
        layer(torch.randn(2, 48, dtype=torch.bfloat16))          # the 2-16-row products use the copy
        layer(torch.randn(20, 48, dtype=torch.bfloat16))         # MKL wins the 17-128-row timing
        assert layer._packed is not None
        PRODUCT_PATHS.reset()
        layer(torch.randn(20, 48, dtype=torch.bfloat16))         # now nothing else uses it
    assert layer._packed is None


def test_bf16_products_of_a_few_rows_never_time_a_copy():
    """Up to 16 rows a product is bound by reading W: oneDNN's copy is not among its candidates."""
    assert all(path != ONEDNN for _, path in path_timing.candidates(torch.bfloat16, 1, None))


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
    pytest.param(NATIVE, (1, 5), marks=pytest.mark.skipif(not native.available(), reason="no native kernels")),
])
def test_a_forced_path_takes_every_product_of_a_model_untimed(path, rows, monkeypatch):
    """cpu_products=<path>: every product of a tiny random model the path can take (every row class;
    the native kernel: up to 16 rows) runs on it, the same product as F.linear, and nothing is timed."""
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
    monkeypatch.setattr(path_timing, "median_seconds", lambda fn, repeats=7: (fn(), 1.0)[1])
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
    monkeypatch.setattr(path_timing, "median_seconds", lambda fn, repeats=7: (fn(), 1.0)[1])
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
    ({"2-16": "numpy"}, "row class 2-16: numpy takes one-row products only (row class 1)"),
    ({"17-128": NATIVE}, "row class 17-128: native takes products of up to 16 rows only (row classes 1, 2-16)"),
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
