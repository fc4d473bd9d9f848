"""attention=paged backend=auto: the decode kernel chosen by timing (ablate_attention.decode_timing).

The mechanism is tested, not this machine's speed: the candidates' times are made up (a stand-in for
decode_timing.measure that still runs the candidate, so the output is real) or the clock is. Every
output is compared with the PyTorch block-table gather, the reference the kernels' own tests use.
Triton's interpreter is switched on before triton is first imported (the environment line)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import ablate_kernels  # noqa: E402
from ablate.api import native  # noqa: E402
from ablate.api.context import EngineConfig  # noqa: E402
from ablate.api.kv import PagedKV  # noqa: E402
from ablate.api.plugin import Slot  # noqa: E402
from ablate.api.sequence import Request, Sequence  # noqa: E402
from ablate.api.step import StepInputs  # noqa: E402
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm  # noqa: E402
from ablate_attention import decode_timing  # noqa: E402
from ablate_attention.paged import gathered_attention  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")
needs_triton = pytest.mark.skipif(
    not ablate_kernels.triton_available("cpu"),
    reason="triton was imported before TRITON_INTERPRET=1 was set (run this module on its own)")


@pytest.fixture(autouse=True)
def fresh_choices():
    """Every test starts with no choice made in the process, and leaves the table as it found it."""
    saved = decode_timing.reset()
    yield
    decode_timing.restore(saved)


@pytest.fixture
def fake_times(monkeypatch):
    """times[name] = seconds the named candidate takes; `measured` lists the candidates timed."""
    times: dict[str, float] = {}
    measured: list[str] = []

    def measure(name, fn, device):
        measured.append(name)
        return times[name], fn()

    monkeypatch.setattr(decode_timing, "measure", measure)
    return times, measured


def decode_step(context_lens: list[int], block_size: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                seed: int = 0) -> tuple[torch.Tensor, PagedKV, StepInputs]:
    """One decode step over a pool of shuffled blocks, garbage in the slots no sequence owns."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-c // block_size) for c in context_lens]
    order = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    tables = torch.zeros(len(context_lens), max(counts), dtype=torch.int32)                 # (B, nb)
    for b, n in enumerate(counts):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    k, v = (torch.randn(sum(counts) + 3, block_size, kv_heads, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen)                      # (B, H, D)
    batch = len(context_lens)
    step = StepInputs(
        seqs=[Sequence(Request(b, (1,) * c, 1)) for b, c in enumerate(context_lens)],
        input_ids=torch.ones(batch, dtype=torch.long), positions=torch.tensor([c - 1 for c in context_lens]),
        query_lens=[1] * batch, context_lens=list(context_lens), query_starts=list(range(batch + 1)),
        logits_indices=torch.arange(batch), query_starts_t=torch.arange(batch + 1, dtype=torch.int32))
    return q, PagedKV(k, v, tables), step


def build(registry, model, backend: str = "auto"):
    arm = resolve_arm("t", {"kv_cache": {"name": "paged", "block_size": 4},
                            "attention": {"name": "paged", "backend": backend}}, baseline_configs(registry), registry)
    return build_arm(arm, model, EngineConfig(max_num_seqs=3), 24, registry)


def attend(attention, context_lens: list[int], **shape) -> None:
    """One decode step through `attention`, checked against the gather."""
    q, view, step = decode_step(context_lens, **shape)
    torch.testing.assert_close(attention(q, view, step), gathered_attention(q, view, step), atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("winner, loser", [("native", "torch"), ("torch", "native")])
def test_the_faster_is_chosen_and_reused_for_its_key_without_timing_again(winner, loser, fake_times, ablate_registry,
                                                                           ablate_tiny_model):
    times, measured = fake_times
    times.update({winner: 1.2e-3, loser: 1.9e-3})
    attention = build(ablate_registry, ablate_tiny_model).plugins[Slot.ATTENTION]
    assert attention.candidates == ("native", "torch")
    before = decode_timing.timings()
    attend(attention, [5, 9, 12])
    assert sorted(measured) == ["native", "torch"] and decode_timing.timings() == before + 1
    [(key, choice)] = attention.chosen.items()
    assert choice.kernel == winner and decode_timing.choice_for(key) is choice
    ran = []
    run = attention._run
    attention._run = lambda kernel, *args: ran.append(kernel) or run(kernel, *args)
    attend(attention, [3, 30, 7, 11], seed=1)             # batch 2-16, context up to 512: the same key
    assert ran == [winner]
    assert len(measured) == 2 and decode_timing.timings() == before + 1 and attention.decode_timings == 1
    assert attention.stats() == {"backends": f"paged(decode={winner}(timed: {winner} 1.2 ms, {loser} 1.9 ms))",
                                 "decode_timings": 1}
    second = build(ablate_registry, ablate_tiny_model).plugins[Slot.ATTENTION]    # another arm of the process
    attend(second, [4, 6])
    assert len(measured) == 2 and second.decode_timings == 0
    assert second.stats()["backends"] == attention.stats()["backends"]


@needs_native
def test_another_key_times_again_and_every_choice_is_listed(fake_times, ablate_registry, ablate_tiny_model):
    times, measured = fake_times
    times.update({"native": 1e-3, "torch": 2e-3})
    attention = build(ablate_registry, ablate_tiny_model).plugins[Slot.ATTENTION]
    attend(attention, [5, 9])                              # batch 2-16, context up to 512
    attend(attention, [7])                                 # batch 1
    times.update({"native": 3e-3})
    attend(attention, [600, 9])                            # context 513-2048: torch now faster
    attend(attention, [5, 9], block_size=8)                # another block size
    attend(attention, [5, 9], heads=8)                     # 4 query heads per KV head
    assert len(measured) == 10 and attention.decode_timings == 5
    listed = decode_timing.decode_choices()
    assert len(listed) == 5
    assert listed[f"cpu float32 2 kv heads x 16, 2 q/kv, block 4, batch 2-16, context 513-2048, "
                  f"{torch.get_num_threads()} threads"] == "torch(timed: torch 2 ms, native 3 ms)"
    backend = attention.stats()["backends"]
    assert "native(batch 1, context 1-512, timed: native 1 ms, torch 2 ms)" in backend
    assert "torch(batch 2-16, context 513-2048, timed: torch 2 ms, native 3 ms)" in backend


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native),
                                     pytest.param("triton", marks=needs_triton)])
def test_forcing_a_backend_never_times(backend, monkeypatch, ablate_registry, ablate_tiny_model):
    monkeypatch.setattr(decode_timing, "measure", lambda *args: pytest.fail("a forced backend was timed"))
    before = decode_timing.timings()
    built = build(ablate_registry, ablate_tiny_model, backend)
    attention = built.plugins[Slot.ATTENTION]
    assert attention.candidates == ()
    attend(attention, [5, 9, 12])
    built.engine.run([Request(0, (1, 2, 3), 3)])
    assert decode_timing.timings() == before and decode_timing.decode_choices() == {}
    kernel = ablate_kernels.backend_label("cpu") if backend == "triton" else backend
    assert built.stats()["attention.backends"] == f"paged(decode={kernel},prefill=torch)"
    assert built.stats()["attention.decode_timings"] == 0


@needs_native
@pytest.mark.parametrize("winner", ["native", "torch"])
def test_a_run_under_auto_makes_the_baseline_tokens_whichever_wins(winner, fake_times, ablate_registry,
                                                                   ablate_tiny_model):
    times, _ = fake_times
    times.update({"native": 1e-3, "torch": 1e-3, winner: 0.5e-3})
    rng = random.Random(0)
    requests = [Request(i, tuple(rng.randrange(256) for _ in range(p)), n)
                for i, (p, n) in enumerate([(3, 5), (9, 3), (14, 4)])]
    arm = resolve_arm("t", {}, baseline_configs(ablate_registry), ablate_registry)
    baseline = [s.output_token_ids for s in
                build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=3), 24, ablate_registry).engine.run(requests)]
    built = build(ablate_registry, ablate_tiny_model)
    assert [s.output_token_ids for s in built.engine.run(requests)] == baseline
    stats = built.stats()                     # the declared stats, as the results take them
    assert stats["attention.decode_timings"] >= 1
    assert stats["attention.backends"].startswith(f"paged(decode={winner}(")
    assert {c.kernel for c in built.plugins[Slot.ATTENTION].chosen.values()} == {winner}


@needs_native
def test_a_step_that_cannot_be_timed_runs_the_default_kernel_and_chooses_nothing(monkeypatch, ablate_registry,
                                                                                   ablate_tiny_model):
    monkeypatch.setattr(decode_timing, "can_time", lambda device: False)     # as inside a CUDA graph's capture
    monkeypatch.setattr(decode_timing, "measure", lambda *args: pytest.fail("timed inside a capture"))
    attention = build(ablate_registry, ablate_tiny_model).plugins[Slot.ATTENTION]
    attend(attention, [5, 9, 12])
    assert attention.stats() == {"backends": "paged(decode=native)", "decode_timings": 0}
    assert decode_timing.decode_choices() == {}


@needs_triton
def test_triton_and_the_gather_are_timed_as_on_a_gpu(fake_times, ablate_registry, ablate_tiny_model):
    """On a GPU auto times Triton against the gather; here the interpreter stands in for the GPU."""
    times, measured = fake_times
    times.update({"triton": 1e-3, "torch": 2e-3})
    attention = build(ablate_registry, ablate_tiny_model, "torch").plugins[Slot.ATTENTION]
    attention.decode_kernel, attention.candidates = "triton", ("triton", "torch")   # what auto sets on a GPU
    attend(attention, [1, 7, 16, 23])
    attend(attention, [5, 33])
    assert measured == ["triton", "torch"]
    assert attention.stats()["backends"] == "paged(decode=triton(timed: triton 1 ms, torch 2 ms))"


def test_measure_times_the_runs_after_a_warm_up_and_takes_their_median(monkeypatch):
    clock = itertools.chain([10.0, 10.5, 20.0, 20.1, 30.0, 30.3], itertools.repeat(99.0))
    monkeypatch.setattr(decode_timing.time, "perf_counter", lambda: next(clock))
    calls = []

    def run():
        calls.append(len(calls))
        return torch.full((1,), float(len(calls)))

    seconds, out = decode_timing.measure("native", run, torch.device("cpu"))
    assert len(calls) == 1 + decode_timing.TIMED_RUNS == 4      # the warm-up call is not timed
    assert seconds == pytest.approx(0.3) and out.item() == 4.0  # median of 0.5, 0.1, 0.3; the last output


def test_the_key_classes_batch_size_and_context_length():
    q, view, _ = decode_step([5])
    key = decode_timing.decode_key(q.expand(3, -1, -1), view.k_cache, [2048, 1, 1])
    assert (key.kv_heads, key.head_dim, key.group, key.block_size) == (2, 16, 2, 4)
    assert key.classes() == "batch 2-16, context 513-2048"
    assert decode_timing.decode_key(q, view.k_cache, [2049]).classes() == "batch 1, context 2049+"
    assert decode_timing.decode_key(q.expand(17, -1, -1), view.k_cache, [9] * 17).classes() == "batch 17+, context 1-512"


def test_the_core_counts_each_timing_and_lists_each_choice(monkeypatch):
    """Through ablate.api.tuning: runs.csv's path_timings adds the count, environment.json lists the choice."""
    import torch

    from ablate.api import tuning
    from ablate_attention import decode_timing

    saved = decode_timing.reset()
    before = tuning.timings()
    try:
        key = ("cpu", "float32", 1, 4, 1, 4, "1", "1-512", 1)
        choice, out = decode_timing.time_decode(key, {"a": lambda: torch.zeros(1), "b": lambda: torch.ones(1)},
                                                torch.device("cpu"))
        assert tuning.timings() == before + 1
        assert tuning.choices()["attention=paged decode"][str(key)] == choice.label()
    finally:
        decode_timing.restore(saved)
