"""ablate's native CPU kernels (ablate/model/native/): built here, equal to torch's arithmetic (the
one-token steps' kernels and the paged decode attention), sharing torch's threads, timed against the
other product paths, and absent without a compiler."""
import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ablate.model.linear as linear
import ablate.model.path_timing as path_timing
from ablate.model import native, numpy_blas
from ablate.model.native import build as native_build
from ablate.model.presets import preset
from ablate.model.linear import Linear
from ablate.model.llama import LlamaModel, RMSNorm
from ablate.model.product_paths import MKL, NATIVE, PRODUCT_PATHS

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    """The native library as in a fresh process, caching its builds under tmp_path (the process's
    library comes back after the test)."""
    monkeypatch.setenv("ABLATE_CACHE_DIR", str(tmp_path))
    with native.LIBRARY.fresh():
        yield tmp_path


@needs_native
@pytest.mark.parametrize("d_out, d_in", [(80, 48), (7, 5), (33, 100), (17, 16), (1, 1), (960, 576)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matvec_computes_f_linear(d_out, d_in, rows, bias, threads):
    """Whole and partial blocks of 8 rows of W, inputs shorter than and not a multiple of one vector,
    one to 16 rows of input, on W as the model holds it."""
    torch.manual_seed(0)
    w, x = torch.randn(d_out, d_in), torch.randn(rows, d_in)
    b = torch.randn(d_out) if bias else None
    got = native.matvec(w, x, b, threads)
    assert got.shape == (rows, d_out)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)    # sums in another order


@needs_native
@pytest.mark.parametrize("shape", [(1, 576), (3, 576), (16, 100), (1, 1, 7)])
def test_rms_norm_computes_torchs(shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape[-1])
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), F.rms_norm(x, shape[-1:], w, 1e-5), atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("shape", [(1, 576), (3, 576), (16, 100), (1, 1, 7)])
def test_bf16_rms_norm_computes_the_models_bf16_norm(shape):
    """Normalised in fp32, rounded to bf16, times the weight in bf16: the model's own bf16 RMSNorm, to
    within one bf16 rounding (its sum of squares may run in another order)."""
    torch.manual_seed(0)
    x, w = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape[-1], dtype=torch.bfloat16)
    want = (F.rms_norm(x.float(), shape[-1:], eps=1e-5).to(torch.bfloat16) * w).float()
    got = native.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    assert bool(((got.float() - want).abs() <= 2.0 ** -7 * want.abs()).all())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 2000])     # 2000 x 24 floats: past PARALLEL_FLOATS, split between threads
def test_rmsnorm_takes_the_kernel_at_any_row_count(rows, dtype, monkeypatch):
    calls = []
    kernel = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *args: calls.append(1) or kernel(*args))
    norm = RMSNorm(24, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, 24, dtype=dtype)
    with torch.inference_mode():
        got = norm(x)
    assert len(calls) == (dtype == torch.float32 or rows <= native.BF16_ROWS)
    want = F.rms_norm(x.float(), (24,), eps=1e-6).to(dtype) * norm.weight.detach()
    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@needs_native
def test_a_norm_whose_input_keeps_a_gradient_takes_torchs_path(monkeypatch):
    """The kernels keep no autograd graph: where one is needed, torch's operations run, and the gradient flows."""
    monkeypatch.setattr(native, "rms_norm", lambda *args: pytest.fail("the kernel ran on a tensor that needs a gradient"))
    x = torch.randn(3, 24, requires_grad=True)
    RMSNorm(24, 1e-6)(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@needs_native
@pytest.mark.parametrize("tokens, heads, dim", [(1, 12, 64), (5, 3, 8)])
def test_rope_computes_rotate_half(tokens, heads, dim):
    from ablate.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(dim, 64, 10000.0)
    cos, sin = rope.tables(torch.arange(30, 30 + tokens), torch.float32)               # (T, 1, D)
    x = torch.randn(tokens, heads, dim)
    x1, x2 = x.chunk(2, dim=-1)
    torch.testing.assert_close(native.rope(x, cos, sin), x * cos + torch.cat((-x2, x1), dim=-1) * sin)


@needs_native
@pytest.mark.parametrize("rows, width", [(3, 40), (100, 400)])   # 2 vectors + a tail of 8; 100 x 400: split between threads
def test_silu_mul_computes_swiglus_activation(rows, width):
    gate_up = torch.randn(rows, 2 * width) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -90.0])    # exp16's ends: e^-|g| of 0 and below -60
    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up)


@needs_native
@pytest.mark.parametrize("tokens", [1, native.SMALL_ROWS + 1, 700])
def test_a_layer_takes_the_elementwise_kernels_at_any_token_count(tokens, monkeypatch):
    """Inside a decoder layer: RoPE and SwiGLU's activation through the kernels, a decode token or a
    prefill's hundreds (split between threads), the same values as torch's operations."""
    from ablate.model.rope import apply_rope

    model = LlamaModel.random(preset("tiny"))
    mlp = model.layers[0].mlp
    calls = []
    for name in ("rope", "silu_mul"):
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    x = torch.randn(tokens, model.config.d_model)
    q = torch.randn(tokens, 4, model.config.head_dim)
    cos, sin = model.rope.tables(torch.arange(tokens), torch.float32)
    with torch.inference_mode():
        got_mlp, got_rope = mlp(x), apply_rope(q, cos, sin)
    assert calls == ["silu_mul", "rope"]
    gate, up = F.linear(x, mlp.w_gate_up.weight).split(mlp.d_ff, dim=-1)
    torch.testing.assert_close(got_mlp, F.linear(F.silu(gate) * up, mlp.w_down.weight), atol=1e-4, rtol=1e-4)
    q1, q2 = q.chunk(2, dim=-1)
    torch.testing.assert_close(got_rope, q * cos + torch.cat((-q2, q1), dim=-1) * sin)


@needs_native
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc to read the loaded libraries from")
def test_one_openmp_runtime_in_the_process():
    """The kernels' parallel regions run on torch's OpenMP pool: a second runtime would bring a second
    pool of workers spinning against torch's on the same cores."""
    native.library()
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(gomp) <= 1, gomp


@needs_native
def test_the_build_is_cached_by_source_compiler_and_cpu(unbuilt, monkeypatch):
    assert native.state() == "not asked for" and not list(unbuilt.glob("native-*.so"))   # recording builds nothing
    assert native.available() and native.state().startswith("built, ")
    [built] = unbuilt.glob("native-*.so")
    mtime = built.stat().st_mtime_ns
    native.LIBRARY.forget()
    assert native.available() and built.stat().st_mtime_ns == mtime       # loaded, not built again
    native.LIBRARY.forget()
    monkeypatch.setattr(native_build, "_cpu_signature", lambda: "another CPU")
    assert native.available() and len(list(unbuilt.glob("native-*.so"))) == 2


# Every way a cached library's bytes can stop being those it was built with
DAMAGES = {
    "emptied": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "cut by a byte": lambda data: data[:-1],
    "garbage": lambda data: bytes(len(data)),
    "one byte changed": lambda data: data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:],
}


def cached_library() -> Path:
    """The library built into the cache and not loaded: damaging a library this process has mapped
    would crash the test itself."""
    return native_build._build(os.environ.get("CC", "cc"))


def damage(path: Path, how: str) -> None:
    path.write_bytes(DAMAGES[how](path.read_bytes()))      # in place, as a full disk or a stray `>` would


@needs_native
@pytest.mark.parametrize("how", [   # a rebuild each (~1 s): one in the default run
    pytest.param(how, marks=[] if how == "garbage" else pytest.mark.slow) for how in DAMAGES])
def test_a_damaged_cached_library_is_rebuilt_before_it_is_loaded(how, unbuilt):
    damage(cached_library(), how)
    assert native.available() and native.state().startswith("built, ")
    [rebuilt] = unbuilt.glob("native-*.so")                # in its place (or beside it, the damaged one gone)
    assert native_build._damage(rebuilt) is None
    x, w = torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5), atol=1e-5, rtol=1e-5)


@needs_native
def test_a_damaged_cached_library_that_cannot_be_rebuilt_is_one_warning(unbuilt, monkeypatch):
    built = cached_library()
    damage(built, "truncated")

    def compiler_fails(cc, cache, key):
        raise RuntimeError(f"{cc} failed: ['steps.c:1: error: out of disk space']")

    monkeypatch.setattr(native_build, "_compile", compiler_fails)
    with pytest.warns(UserWarning) as warned:
        assert not native.available()
    (message,) = [str(w.message) for w in warned]
    assert "\n" not in message
    assert message.startswith(f"ablate: the cached native library {built} is ")
    assert "(truncated or overwritten), and rebuilding it failed: " in message and "out of disk space" in message
    assert message.endswith("the native kernels are off")
    assert native.unavailable_reason() in message and built.exists()    # left for the user to look at


@needs_native
def test_a_cache_entry_not_named_by_its_digest_is_not_loaded(unbuilt):
    """A library copied in by hand (or from the old cache layout) under the key's name is not trusted."""
    built = cached_library()
    stray = built.with_name(built.name.rpartition("-")[0] + "-copied.so")
    stray.write_bytes(b"\x7fELF" + bytes(100))
    built.unlink()
    assert native.available()
    assert [p.name for p in unbuilt.glob("native-*.so")] == [built.name] and not stray.exists()


# builds (or finds) the kernels and calls one: a truncated library loaded would be a SIGBUS here
BUILD_AND_CALL = """
import torch
from ablate.model import native
print(native.available(), native.unavailable_reason())
native.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5)
"""


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("start_with", ["an empty cache", "a truncated library"])
def test_processes_building_at_once_never_load_half_a_library(start_with, unbuilt):
    """Two processes that find no intact library build at the same moment: each sees no file or a whole
    one (a truncated library once loaded is a SIGBUS at its first call), and both load the kernels."""
    env = {**os.environ, "ABLATE_CACHE_DIR": str(unbuilt), "OMP_NUM_THREADS": "1"}
    if start_with == "a truncated library":
        built = cached_library()
        damage(built, "truncated")
    workers = [subprocess.Popen([sys.executable, "-c", BUILD_AND_CALL], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-2000:]
        assert out.startswith("True None"), out + err
    [library] = unbuilt.glob("native-*.so")
    assert native_build._damage(library) is None
    assert not [p for p in unbuilt.iterdir() if p.is_dir()]          # no build folder left behind


@pytest.mark.parametrize("why", ["no compiler", "switched off"])
def test_without_the_kernels_products_and_norms_take_torchs_paths(why, unbuilt, fresh_product_paths, monkeypatch):
    monkeypatch.setenv("CC", str(unbuilt / "no-such-cc"))
    with native.LIBRARY.switched_off("off for this test") if why == "switched off" else contextlib.nullcontext():
        assert not native.available()
        reason = native.unavailable_reason()
        assert ("no-such-cc" in reason) if why == "no compiler" else (reason == "off for this test")
        model = LlamaModel.random(preset("tiny"))
        x = torch.randn(1, model.config.d_model)
        with torch.inference_mode():
            got = model.layers[0].mlp(model.layers[0].mlp_norm(x))
        assert PRODUCT_PATHS.choices()["native kernels"] == reason
        assert NATIVE not in PRODUCT_PATHS.choices().values()
    mlp = model.layers[0].mlp
    h = F.rms_norm(x, x.shape[-1:], model.layers[0].mlp_norm.weight, model.config.norm_eps)
    gate, up = F.linear(h, mlp.w_gate_up.weight).split(mlp.d_ff, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, mlp.w_down.weight), atol=1e-4, rtol=1e-4)


@needs_native
def test_where_the_kernel_wins_it_runs_every_layer_of_the_shape_on_the_weights_in_place(fresh_product_paths,
                                                                                        monkeypatch):
    """The clock says native: every layer of the shape runs on it, its weight laid out row-major in
    place (the same values, no copy beside it)."""
    pairs = path_timing.candidates(torch.float32, 0, None)
    costs = iter([0.5 if pair == (linear.ROW_MAJOR, NATIVE) else 1.0 for pair in pairs])
    monkeypatch.setattr(path_timing, "median_seconds", lambda fn, repeats=7: (fn(), next(costs))[1])
    monkeypatch.setattr(numpy_blas, "blas_threads", lambda threads: False)
    layers = [Linear(48, 80, bias=True) for _ in range(2)]
    for m in layers:
        m.input_major()
    want = [m.weight.detach().clone() for m in layers]
    calls = []
    kernel = native.matvec
    monkeypatch.setattr(native, "matvec", lambda *args: calls.append(1) or kernel(*args))
    x = torch.randn(1, 48)
    with torch.inference_mode():
        layers[0](x)
        calls.clear()
        got = layers[1](x)
    assert calls == [1]
    assert all(torch.equal(m.weight, w) and m.weight.is_contiguous() and m._packed is None
               for m, w in zip(layers, want))
    assert linear.copy_bytes(layers[0]) + linear.copy_bytes(layers[1]) == 0
    assert PRODUCT_PATHS.choices()[f"80x48 float32 1 rows {torch.get_num_threads()} threads"] == NATIVE
    torch.testing.assert_close(got, F.linear(x, want[1], layers[1].bias), atol=1e-5, rtol=1e-5)


@needs_native
def test_a_batch_1_decode_on_the_kernels_gives_torchs_tokens(ablate_registry, fresh_product_paths, monkeypatch):
    """Through the engine, forced (cpu_products=native): every product of up to 16 rows on the native kernel
    (and RMSNorm on its own) gives the greedy tokens of torch's paths."""
    from ablate.api.context import EngineConfig
    from ablate.api.sequence import Request
    from ablate.testing.scenarios import build

    model = LlamaModel.random(preset("tiny"))

    native_layers = []

    def tokens(path: str) -> list[int]:
        PRODUCT_PATHS.force(path)
        built = build(ablate_registry, {"kv_cache": "contiguous", "attention": "sdpa"}, model, EngineConfig(), 64)
        try:
            return built.engine.run([Request(0, tuple(range(3, 19)), 12)])[0].output_token_ids
        finally:
            native_layers.append(built.engine.runner.layer_stats()["native_layers"])
            built.close()

    with PRODUCT_PATHS.without_native("off"):
        want = tokens(MKL)
    calls = []
    kernel = native.matvec
    monkeypatch.setattr(native, "matvec", lambda *args: calls.append(1) or kernel(*args))
    assert tokens(NATIVE) == want
    # 11 decode steps; the 16-token prompt (16 rows: the kernel takes up to 16) through every product,
    # the head's on its last token only; a layer run as native calls (ablate/model/native/layers.py) makes
    # its 4 products on the kernel inside them
    assert native_layers[-1] > 0
    assert len(calls) + 4 * native_layers[-1] == 12 * len([m for m in model.modules() if isinstance(m, Linear)])


# -- paged decode attention (paged_attention.c), which attention=paged calls through ablate.api.native --

def paged_decode_case(context_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      seed: int = 0):
    """One decode step's query and a pool of KV blocks handed out in a shuffled order, with garbage in
    every slot no sequence owns (it must never be read) -> q (B, H, D), k_cache, v_cache (N, bs, H_kv, D),
    block_tables (B, max_blocks) int32, context_lens (B) int32."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    tables = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(tables) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(batch, max(tables), dtype=torch.int32)
    for b, n in enumerate(tables):
        block_tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def attention_over_blocks(q, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    """The definition: softmax(q K^T / sqrt(D)) V over each sequence's keys, gathered from its blocks
    in table order, each query head reading KV head h // (H / H_kv) -> (B, H, D)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, :-(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, dim=1)      # (n, H, D)
        v = v_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v))
    return torch.stack(out)


@needs_native
@pytest.mark.parametrize("context_lens, block_size, heads, head_dim", [
    ([1, 7, 16, 23], 4, (4, 2), 16),     # grouped-query: 2 query heads per KV head; partial and full last blocks
    ([5, 33], 16, (2, 2), 64),
    ([9], 1, (4, 1), 24),                # one token per block; multi-query; a width that is not a whole vector
    ([130, 3, 64], 16, (9, 3), 64),      # SmolLM2's heads
    ([40, 1, 17, 33, 2, 64, 5, 16, 70], 32, (20, 2), 32),   # groups of 10 heads (two slices); tasks of whole sequences
    ([200], 16, (9, 3), 64),             # batch 1: each KV head's blocks in parts, merged
    ([9], 16, (9, 3), 64),               # one block in two parts: one part holds no key
    ([0], 16, (9, 3), 64),               # no key in any part: zeros, as the reference gives
    ([1, 77], 8, (8, 1), 32),            # multi-query, two sequences: parts
])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_paged_decode_attention_computes_attention_over_the_blocks(context_lens, block_size, heads, head_dim, threads):
    q, k_cache, v_cache, tables, lens = paged_decode_case(context_lens, block_size, *heads, head_dim=head_dim)
    assert native.paged_decode_problem(q, k_cache, v_cache) is None
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, threads)
    torch.testing.assert_close(got, attention_over_blocks(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)


@needs_native
def test_paged_decode_attention_says_what_it_cannot_take():
    q, k_cache, v_cache, _, _ = paged_decode_case([5], 4, 4, 2, head_dim=16)
    assert "fp32 only" in native.paged_decode_problem(q.half(), k_cache.half(), v_cache.half())
    assert "divide" in native.paged_decode_problem(q[:, :3], k_cache, v_cache)
    assert "one width" in native.paged_decode_problem(q, k_cache, v_cache[..., :8])
    assert "exceed" in native.paged_decode_problem(torch.randn(1, 64, 1024), *[torch.randn(2, 16, 1, 1024)] * 2)
    assert "blocks of 512" in native.paged_decode_problem(q, *[torch.randn(2, 512, 2, 16)] * 2)


def test_without_the_kernels_paged_decode_attention_says_why():
    with native.LIBRARY.switched_off("off for this test"):
        q, k_cache, v_cache, _, _ = paged_decode_case([5], 4, 2, 2, head_dim=16)
        assert native.paged_decode_problem(q, k_cache, v_cache) == "no native kernels (off for this test)"


@needs_native
@pytest.mark.parametrize("d_out, d_in, rows", [(80, 48, 1), (7, 5, 3), (960, 576, 16), (33, 100, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_matvec_on_bf16_weights_computes_torchs_bf16_product(d_out, d_in, rows, bias):
    """bf16 W, x and bias: sums in fp32, rounded once to bf16 as PyTorch's bf16 F.linear rounds: within
    one bf16 rounding of it, and of the exact product on the same bf16 inputs."""
    torch.manual_seed(0)
    w, x = torch.randn(d_out, d_in, dtype=torch.bfloat16), torch.randn(rows, d_in, dtype=torch.bfloat16)
    b = torch.randn(d_out, dtype=torch.bfloat16) if bias else None
    got = native.matvec(w, x, b, 2)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, d_out)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    ulp = 2.0 ** -7 * exact.abs().clamp_min(1e-3)               # one bf16 rounding of each output
    assert bool(((got.float() - exact).abs() <= ulp).all())


@needs_native
@pytest.mark.parametrize("wrong", ["narrower input", "input-major W", "short bias", "17 rows", "bf16 W, fp32 x",
                                   "fp16 W"])
def test_matvec_refuses_what_would_read_past_its_buffers(wrong):
    """The C kernel trusts its pointers: a W not row-major, an input of another width, a short bias or
    more than 16 rows is a ValueError before the call, never a read past the end of a buffer."""
    w, x, bias = torch.randn(24, 40), torch.randn(1, 40), torch.randn(24)
    if wrong == "narrower input":
        x = torch.randn(1, 8)
    elif wrong == "input-major W":
        w = w.t().contiguous().t()
    elif wrong == "short bias":
        bias = torch.randn(3)
    elif wrong == "17 rows":
        x = torch.randn(17, 40)
    elif wrong == "bf16 W, fp32 x":
        w = w.bfloat16()
    else:
        w, x, bias = w.half(), x.half(), bias.half()
    with pytest.raises(ValueError, match="native matvec: W"):
        native.matvec(w, x, bias, 1)


def test_a_layer_lays_its_weight_out_for_the_kernel_when_it_is_not():
    """A layer made after its shape chose the native kernel holds W input-major (as loaded): the kernel
    lays it out row-major in place first, rather than reading it wrongly."""
    from ablate.model.linear import Linear

    if not native.available():
        pytest.skip("no native kernels")
    layer = Linear(40, 24, bias=False)
    layer.input_major()
    x = torch.randn(1, 40)
    torch.testing.assert_close(layer._native(x, 1), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert layer.weight.is_contiguous()


def _x86_levels() -> list[tuple[str, int]]:
    """(-march level, floats per vector it compiles vectors.h's vec to) for each x86-64 level this CPU runs:
    SSE2 (4), AVX2 (8), AVX-512 (16); none off x86-64."""
    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists():
        return []
    flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "").split())
    levels = [("x86-64", 4)]
    if {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags:
        levels.append(("x86-64-v3", 8))
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
            levels.append(("x86-64-v4", 16))
    return levels


@needs_native
@pytest.mark.parametrize("march, floats", _x86_levels())
def test_every_vector_width_computes_torchs_results(march, floats, unbuilt, monkeypatch):
    """The kernels compile vectors.h's vec to the machine's vector width (4, 8 or 16 floats): each width
    this CPU runs, built here, computes what torch computes, through the vector bodies, their tails and
    the horizontal sums (the checks of the tests above, on a library built for that width)."""
    monkeypatch.setattr(native_build, "FLAGS",
                        tuple(f"-march={march}" if flag == "-march=native" else flag for flag in native_build.FLAGS))
    assert native.available(), native.unavailable_reason()
    assert native.state() == f"built, {floats}-float vectors"
    for d_out, d_in in [(80, 48), (7, 5), (33, 100), (960, 576)]:
        for rows in (1, 3, 16):
            test_matvec_computes_f_linear(d_out, d_in, rows, bias=True, threads=2)
        test_matvec_on_bf16_weights_computes_torchs_bf16_product(d_out, d_in, 3, bias=True)
    for shape in [(3, 576), (16, 100), (1, 1, 7)]:
        test_rms_norm_computes_torchs(shape)
        test_bf16_rms_norm_computes_the_models_bf16_norm(shape)
    test_rope_computes_rotate_half(5, 3, 8)
    test_silu_mul_computes_swiglus_activation(3, 40)
    for lens, block_size, heads, head_dim in [([1, 7, 16, 23], 4, (4, 2), 16), ([9], 1, (4, 1), 24),
                                              ([130, 3, 64], 16, (9, 3), 64),
                                              ([40, 1, 17, 33, 2, 64, 5, 16, 70], 32, (20, 2), 32)]:
        test_paged_decode_attention_computes_attention_over_the_blocks(lens, block_size, heads, head_dim, threads=2)
