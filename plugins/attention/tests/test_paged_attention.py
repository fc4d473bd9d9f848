"""attention=paged: the Triton paged-decode kernel against the PyTorch block-table path, and the
backend it records (the native CPU kernel's own tests are in tests/test_native.py). The Triton kernel
runs on the CPU under the Triton interpreter, which must be switched on before triton is first
imported (hence the environment line above the imports)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import ablate_kernels  # noqa: E402
from ablate.api.context import EngineConfig  # noqa: E402
from ablate.api.kv import PagedKV  # noqa: E402
from ablate.api.plugin import Slot  # noqa: E402
from ablate.api.sequence import Request, Sequence  # noqa: E402
from ablate.api.step import StepInputs  # noqa: E402
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm  # noqa: E402
from ablate.api import native  # noqa: E402
from ablate_attention import paged as paged_attention  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native kernels: {native.unavailable_reason()}")
needs_triton = pytest.mark.skipif(
    not ablate_kernels.triton_available("cpu"),
    reason="triton was imported before TRITON_INTERPRET=1 was set (run this module on its own)")


def decode_step(context_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                seed: int = 0, query_lens: list[int] | None = None) -> tuple[torch.Tensor, PagedKV, StepInputs]:
    """One step over a pool whose blocks are handed out in a shuffled order, with garbage in every
    slot no sequence owns (it must never be read): a decode step, or with query_lens each sequence's
    last query_lens[b] tokens fed (a prompt, a chunk of one, or one token)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    query_lens = query_lens or [1] * batch
    tables = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(tables) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(tables)
    block_tables = torch.zeros(batch, width, dtype=torch.int32)                     # (B, nb)
    for b, n in enumerate(tables):
        block_tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)   # (N, bs, H_kv, D)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    starts = [0, *itertools.accumulate(query_lens)]
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)                       # (T, H, D)
    seqs = [Sequence(Request(b, (1,) * c, 1)) for b, c in enumerate(context_lens)]
    step = StepInputs(
        seqs=seqs, input_ids=torch.ones(starts[-1], dtype=torch.long),
        positions=torch.tensor([p for c, n in zip(context_lens, query_lens) for p in range(c - n, c)]),
        query_lens=list(query_lens), context_lens=list(context_lens), query_starts=starts,
        logits_indices=torch.tensor(starts[1:]) - 1, query_starts_t=torch.tensor(starts, dtype=torch.int32))
    return q, PagedKV(k_cache, v_cache, block_tables), step


def reference_attention(q: torch.Tensor, view: PagedKV, step: StepInputs) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v for each sequence, its keys read one at a time through
    its block table (query i of n sees keys 0 .. L - n + i). q (T, H, D) -> (T, H, D)."""
    outs, bs = [], view.block_size
    for b in range(step.num_seqs):
        length, n = step.kv_lens[b], step.query_lens[b]
        slots = [(int(view.block_tables[b, p // bs]), p % bs) for p in range(length)]
        k = torch.stack([view.k_cache[blk, row] for blk, row in slots])                  # (L, H_kv, D)
        v = torch.stack([view.v_cache[blk, row] for blk, row in slots])
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)              # (L, H, D)
        qb = q[step.query_starts[b]:step.query_starts[b + 1]]                           # (n, H, D)
        scores = torch.einsum("nhd,lhd->hnl", qb, k) / q.shape[-1] ** 0.5               # (H, n, L)
        seen = torch.arange(length - n, length)[:, None] >= torch.arange(length)[None, :]   # (n, L)
        outs.append(torch.einsum("hnl,lhd->nhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("context_lens, query_lens", [
    ([12, 12, 12], [12, 12, 12]),          # whole prompts of one length: SDPA's is_causal
    ([12, 7, 12], [12, 7, 12]),            # whole prompts of two lengths: the mask
    ([20, 9], [6, 9]),                     # a chunk after a prefix beside a whole prompt
    ([9, 16, 5, 23], [1, 16, 1, 7]),       # mixed
    ([9, 30], [1, 1]),                     # decode
])
def test_the_block_table_gather_equals_attention_computed_key_by_key(context_lens, query_lens):
    q, view, step = decode_step(context_lens, 4, 6, 2, 16, seed=3, query_lens=query_lens)
    torch.testing.assert_close(paged_attention.gathered_attention(q, view, step), reference_attention(q, view, step),
                               atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("context_lens, block_size, heads", [
    ([1, 7, 16, 23], 4, (4, 2)),      # grouped-query: 2 query heads per KV head; partial and full last blocks
    ([5, 33], 16, (2, 2)),
    ([9], 1, (4, 1)),                 # one token per block; multi-query
])
def test_triton_kernel_equals_the_pytorch_block_table_path(context_lens, block_size, heads):
    q, view, step = decode_step(context_lens, block_size, *heads, head_dim=16)
    kernel = ablate_kernels.paged_decode_attention(q, view.k_cache, view.v_cache, view.block_tables,
                                                   step.kv_lens_t)                  # (B, H, D)
    torch_path = paged_attention.gathered_attention(q, view, step)                      # (T = B, H, D)
    torch.testing.assert_close(kernel, torch_path, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention, kernel", [
    pytest.param({"name": "paged", "backend": "triton"}, "triton", marks=needs_triton),
    pytest.param({"name": "paged", "backend": "native"}, "native", marks=needs_native),   # auto: test_paged_timing
])
def test_greedy_tokens_through_the_decode_kernel_equal_the_baseline(attention, kernel, ablate_registry,
                                                                   ablate_tiny_model):
    rng = random.Random(0)
    requests = [Request(i, tuple(rng.randrange(256) for _ in range(p)), n)
                for i, (p, n) in enumerate([(3, 5), (9, 3), (14, 4)])]

    def run(spec):
        arm = resolve_arm("t", spec, baseline_configs(ablate_registry), ablate_registry)
        built = build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=3), 24, ablate_registry)
        return [s.output_token_ids for s in built.engine.run(requests)], built

    baseline, _ = run({})
    tokens, built = run({"kv_cache": {"name": "paged", "block_size": 4}, "attention": attention})
    assert tokens == baseline
    if kernel == "triton":
        kernel = ablate_kernels.backend_label(next(ablate_tiny_model.parameters()).device)   # triton(-interpreted)
    assert built.plugins[Slot.ATTENTION].backend == f"paged(decode={kernel},prefill=torch)"


@pytest.mark.parametrize("kernel", [pytest.param("native", marks=needs_native),
                                    pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("context_lens, query_lens", [
    ([9, 16, 5, 23], [1, 16, 1, 7]),      # decodes between a whole prompt and a chunk after a prefix
    ([30, 4, 12], [30, 1, 3]),            # one decode row among prompts
    ([8, 13, 2, 17, 6], [1, 1, 2, 1, 6]), # decode rows first, as the continuous scheduler orders them
])
def test_a_mixed_step_runs_its_decode_rows_through_the_kernel_and_equals_the_gather(
        kernel, context_lens, query_lens, ablate_registry, ablate_tiny_model):
    cfg = ablate_tiny_model.config
    arm = resolve_arm("t", {"kv_cache": "paged", "attention": {"name": "paged", "backend": kernel}},
                      baseline_configs(ablate_registry), ablate_registry)
    built = build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=len(context_lens)), 32, ablate_registry)
    attention = built.plugins[Slot.ATTENTION]
    q, view, step = decode_step(context_lens, 4, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seed=len(context_lens),
                                query_lens=query_lens)
    out = attention(q, view, step)                                                   # (T, H, D)
    torch.testing.assert_close(out, paged_attention.gathered_attention(q, view, step), atol=1e-5, rtol=1e-5)
    label = ablate_kernels.backend_label(q.device) if kernel == "triton" else kernel
    assert attention.backend == f"paged(decode={label},prefill=torch)"
    built.close()


def test_step_parts_keep_their_rows_lengths_and_positions():
    q, view, step = decode_step([9, 16, 5, 23], 4, 2, 1, 8, query_lens=[1, 16, 1, 7])
    part = step.part([3, 0])
    assert part.query_lens == [7, 1] and part.context_lens == [23, 9] and part.kv_lens == [23, 9]
    assert part.query_starts == [0, 7, 8] and part.query_starts_t.tolist() == [0, 7, 8]
    assert part.rows_in_step.tolist() == [*range(18, 25), 0]
    assert part.positions.tolist() == [*range(16, 23), 8] and part.kv_lens_t.tolist() == [23, 9]
    assert [s.seq_id for s in part.seqs] == [3, 0]


def test_greedy_tokens_through_mixed_steps_equal_the_baseline(ablate_registry, ablate_tiny_model, monkeypatch):
    """Continuous batching with chunked prefill: prompts and their chunks share steps with decoding
    sequences, whose rows the decode kernel takes."""
    rng = random.Random(1)
    requests = [Request(i, tuple(rng.randrange(256) for _ in range(p)), n)
                for i, (p, n) in enumerate([(3, 9), (21, 6), (14, 7), (6, 8)])]
    steps = []

    def run(spec, engine):
        arm = resolve_arm("t", spec, baseline_configs(ablate_registry), ablate_registry)
        built = build_arm(arm, ablate_tiny_model, engine, 32, ablate_registry)
        seqs = built.engine.run(requests)
        return [s.output_token_ids for s in seqs], built

    baseline, _ = run({}, EngineConfig(max_num_seqs=4))
    spec = {"kv_cache": {"name": "paged", "block_size": 4}, "attention": "paged",
            "scheduler": {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 5}}
    attention_call = paged_attention.PagedAttention._mixed

    def spy(self, q, view, parts):
        steps.append([p.query_lens for _, p in parts])
        return attention_call(self, q, view, parts)

    monkeypatch.setattr(paged_attention.PagedAttention, "_mixed", spy)
    tokens, _ = run(spec, EngineConfig(max_num_seqs=4, max_num_batched_tokens=8))
    assert tokens == baseline
    assert steps, "no step mixed decoding sequences with prompts"


def test_the_backend_that_ran_is_recorded_and_a_fallback_is_said(ablate_registry, ablate_tiny_model, monkeypatch):
    monkeypatch.setattr(ablate_kernels, "triton_available", lambda device: False)
    monkeypatch.setattr(paged_attention.native, "available", lambda: False)
    monkeypatch.setattr(paged_attention.native, "unavailable_reason", lambda: "no compiler")
    monkeypatch.setattr(paged_attention, "_warned", set())
    arm = resolve_arm("t", {"kv_cache": "paged", "attention": "paged"}, baseline_configs(ablate_registry),
                      ablate_registry)
    with pytest.warns(UserWarning, match="decode steps use the PyTorch block-table gather"):
        built = build_arm(arm, ablate_tiny_model, EngineConfig(max_num_seqs=2), 16, ablate_registry)
    built.engine.run([Request(0, (1, 2, 3), 3)])
    assert built.plugins[Slot.ATTENTION].backend == "paged(decode=torch,prefill=torch)"
    forced = resolve_arm("t", {"kv_cache": "paged", "attention": {"name": "paged", "backend": "triton"}},
                         baseline_configs(ablate_registry), ablate_registry)
    with pytest.raises(ValueError, match="backend=triton: the Triton kernel cannot run on cpu"):
        build_arm(forced, ablate_tiny_model, EngineConfig(max_num_seqs=2), 16, ablate_registry)


def test_paged_attention_needs_a_paged_cache(ablate_registry):
    from ablate.engine.arm import IncompatiblePlugins

    with pytest.raises(IncompatiblePlugins, match="attention=paged cannot run with kv_cache=contiguous"):
        resolve_arm("t", {"kv_cache": "contiguous", "attention": "paged"}, baseline_configs(ablate_registry),
                    ablate_registry)


def test_backend_native_is_refused_where_it_cannot_run(ablate_registry, ablate_tiny_model, monkeypatch):
    monkeypatch.setattr(paged_attention.native, "available", lambda: False)
    monkeypatch.setattr(paged_attention.native, "unavailable_reason", lambda: "could not build native.c with 'cc'")
    forced = resolve_arm("t", {"kv_cache": "paged", "attention": {"name": "paged", "backend": "native"}},
                         baseline_configs(ablate_registry), ablate_registry)
    with pytest.raises(ValueError, match="backend=native: .*could not build native.c"):
        build_arm(forced, ablate_tiny_model, EngineConfig(max_num_seqs=2), 16, ablate_registry)
