"""A windowed layer's KV cache keeps only its window: a ring of R rows per sequence (KVSpec.ring_rows,
R = window - 1 + the most tokens a sequence feeds in one step), masked by each row's position.

Random transformers models with windows of 8 tokens (ablate.testing.hf_models: every layer windowed,
Mistral; one of two, Qwen2; alternating, Gemma 2; three of four, Gemma 3), prompts several windows
long and sequences several rings long, through the engine with the contiguous cache: its logits
within 1e-3 of transformers' and its greedy text transformers' own, in one-step prefills, chunked
prefills, ragged batches, speculative decoding with rejected drafts and replayed decode steps; and
its bytes the rows it keeps, equal to ModelConfig.kv_bytes_at for the live ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from ablate.api import BuildContext, KVSpec, PaddedKV, causal_mask
from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, Sequence
from ablate.api.step import Batch
from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.teacher import teacher_forced_logits
from ablate.testing.hf_models import build_hf, hf_logits, random_prompt, save_hf
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache
from test_graphs import emulate_graphs
from test_model import make_step

pytest.importorskip("transformers")

TOL = 1e-3            # max |logit difference| in fp32
WINDOW = 8            # the kinds' sliding_window
MAX_SEQ_LEN = 64
CHUNKED = {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 8}


def build(registry, model, spec: dict, max_num_batched_tokens: int, max_num_seqs: int = 2, graphs: bool = False):
    arm = resolve_arm("windowed", spec, baseline_configs(registry), registry)
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, graphs=graphs)
    return build_arm(arm, model, engine, MAX_SEQ_LEN, registry)


def requests(prompts: list[list[int]], new_tokens: int) -> list[Request]:
    return [Request(i, tuple(p), new_tokens) for i, p in enumerate(prompts)]


def outputs(seqs) -> list[list[int]]:
    return [s.output_token_ids for s in sorted(seqs, key=lambda s: s.request.request_id)]


def ring_of(built) -> int:
    return built.engine.runner.kv_cache.ring


# -- the mask over a ring ------------------------------------------------------------------------------

def test_the_mask_over_a_ring_sees_each_query_window_by_position():
    """Rows hold positions L - 1 - ((L - 1 - j) mod R): the mask over a ring equals the mask over the
    same keys laid out by position, in a ragged step and in a decode step captured for replay."""
    ring, window = 7, 4
    for query_lens, kv_lens in (([3, 1], [12, 5]), ([1, 1], [12, 5]), ([2, 3], [3, 20])):
        step = make_step(query_lens, kv_lens)
        kv = torch.tensor(kv_lens)[:, None]
        pos = (kv - 1) - ((kv - 1) - torch.arange(ring)[None, :]).remainder(ring)             # (B, R)
        by_row = causal_mask(step, ring, window, ring)                                        # (B, Lq, R)
        by_position = causal_mask(step, max(kv_lens), window)                                 # (B, Lq, S)
        expected = torch.zeros_like(by_row)
        for b in range(len(kv_lens)):
            for j in range(ring):
                if pos[b, j] >= 0:
                    expected[b, :, j] = by_position[b, :, pos[b, j]]
        assert torch.equal(by_row, expected)
        assert by_row.any(-1).all()                                     # padded query rows too: no NaN rows
        if all(q == 1 for q in query_lens):
            graphed = replace(step, graphed=True, _memo={})
            assert torch.equal(causal_mask(graphed, ring, window, ring), by_row)


def test_a_ring_without_its_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        causal_mask(make_step([1], [3]), 4, None, 4)


# -- bytes: the rows each layer keeps --------------------------------------------------------------------

@pytest.mark.parametrize("windows", [(8, 8, 8, 8), (8, None, 8, None), (None, None, None, None), (None, 8, None, 8)],
                         ids=["every-layer", "alternating", "none", "alternating-from-1"])
def test_a_windowed_layer_reserves_its_ring_and_a_full_one_the_sequence(windows):
    spec = KVSpec(4, 2, 16, 16, torch.float32, torch.device("cpu"), max_num_seqs=3, max_seq_len=MAX_SEQ_LEN,
                  windows=windows if any(windows) else (), max_step_tokens=6)
    cache = ContiguousKVCache(ContiguousConfig(), BuildContext(None, spec, EngineConfig(max_num_seqs=3)))
    ring = WINDOW - 1 + 6
    rows = [ring if w else MAX_SEQ_LEN for w in windows]
    assert [spec.ring_rows(layer) for layer in range(4)] == [ring if w else None for w in windows]
    assert cache.bytes_reserved() == 3 * sum(rows) * 2 * 16 * 2 * 4          # slots x rows x heads x (K+V) x fp32
    assert cache.ring == (ring if any(windows) else 0)


def test_no_ring_when_a_step_may_feed_the_whole_sequence():
    spec = KVSpec(2, 2, 16, 16, torch.float32, torch.device("cpu"), 1, MAX_SEQ_LEN, windows=(8, 8),
                  max_step_tokens=MAX_SEQ_LEN - 7)
    assert spec.ring_rows(0) is None


@pytest.mark.parametrize("kind", ["gemma2", "mistral-window"])
def test_measured_bytes_of_a_sequence_are_the_models_kv_bytes_at_its_length(kind, pairs, registry):
    """One sequence of n tokens: the live K/V (bytes_used) is ModelConfig.kv_bytes_at(n), and every
    slot reserves the full layers' max_seq_len rows and the windowed layers' ring."""
    model, _ = pairs(kind)
    cfg = model.config
    built = build(registry, model, {"kv_cache": "contiguous", "attention": "naive"}, max_num_batched_tokens=8)
    cache, ring = built.engine.runner.kv_cache, WINDOW - 1 + 8
    windowed = sum(cfg.layer_window(layer) is not None for layer in range(cfg.n_layers))
    per_layer = cfg.kv_bytes_per_token() // cfg.n_layers
    assert cache.bytes_reserved() == 2 * per_layer * ((cfg.n_layers - windowed) * MAX_SEQ_LEN + windowed * ring)
    seq = Sequence(Request(0, tuple(random_prompt(40)), max_new_tokens=1))
    seq.start()
    for n in (3, 8, 8, 8, 8, 5):            # chunks of at most max_num_batched_tokens
        assert cache.allocate(seq, n)
        built.engine.runner.forward(Batch([seq], [n]))
        seq.advance(n, [1] if seq.num_computed_tokens + n == seq.num_tokens else [])
        cache.commit(seq, seq.num_computed_tokens)
        assert cache.bytes_used() == cfg.kv_bytes_at(seq.num_computed_tokens)
    cache.release(seq)


# -- logits and greedy text equal transformers' ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral-window",
                                  pytest.param("qwen2-window", marks=pytest.mark.slow)])
def test_teacher_forced_logits_through_a_ring_match_transformers(kind, pairs, registry):
    """Two texts of different lengths, prefilled in one step, then fed token by token past several
    rings: every row's logits within 1e-3 of transformers'."""
    model, hf = pairs(kind)
    texts, prefills = [random_prompt(44, seed=2), random_prompt(37, seed=3)], [3 * WINDOW, 3 * WINDOW + 5]
    built = build(registry, model, {"kv_cache": "contiguous", "attention": "naive"}, max_num_batched_tokens=29)
    assert ring_of(built) == WINDOW - 1 + 29 < max(map(len, texts))
    for text, p, ours in zip(texts, prefills, teacher_forced_logits(built.engine.runner, texts, prefills)):
        diff = (ours - hf_logits(hf)(text)[p - 1:-1]).abs().max().item()
        assert diff < TOL, f"max |logit diff| {diff:.2e}"


# kind, cache, attention, max_num_batched_tokens, the scheduler: a ring of 8 - 1 + that many rows
DYNAMIC = {"name": "dynamic", "initial_tokens": 4}
ENGINE_CASES = [
    pytest.param("gemma2", "contiguous", "naive", 8, CHUNKED, id="gemma2-chunked-naive"),
    pytest.param("mistral-window", "contiguous", "sdpa", 8, CHUNKED, id="mistral-chunked-sdpa"),
    pytest.param("gemma3", "contiguous", "sdpa", 30, "continuous", id="gemma3-one-step-prefill-sdpa"),
    pytest.param("qwen2-window", "contiguous", "naive", 8, CHUNKED, id="qwen2-chunked", marks=pytest.mark.slow),
    pytest.param("gemma3", DYNAMIC, "naive", 8, CHUNKED, id="gemma3-dynamic", marks=pytest.mark.slow),
    pytest.param("gemma2", "contiguous", "naive", 30, "continuous", id="gemma2-one-step-prefill",
                 marks=pytest.mark.slow),
]
PROMPTS = [random_prompt(3 * WINDOW, seed=2), random_prompt(3 * WINDOW + 5, seed=3)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def expected(hf_greedy):
    """kind -> transformers' greedy continuation of each prompt."""
    return lambda kind: hf_greedy(kind, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("kind, kv_cache, attention, max_num_batched_tokens, scheduler", ENGINE_CASES)
def test_the_engine_decodes_transformers_greedy_text_through_a_ring(kind, kv_cache, attention, max_num_batched_tokens,
                                                                    scheduler, pairs, registry, expected):
    """Two sequences of different lengths in one batch, each longer than its ring, give
    transformers' greedy text, and the same text as a cache that keeps every position."""
    model, _ = pairs(kind)
    spec = {"kv_cache": kv_cache, "attention": attention, "scheduler": scheduler}
    built = build(registry, model, spec, max_num_batched_tokens)
    assert 0 < ring_of(built) < len(PROMPTS[0]) + NEW_TOKENS
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected(kind)
    keeps_all = build(registry, model, spec | {"kv_cache": DYNAMIC}, MAX_SEQ_LEN)      # steps up to a whole sequence
    assert ring_of(keeps_all) == 0
    assert outputs(keeps_all.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected(kind)


@pytest.mark.parametrize("kind, drafter", [
    ("mistral-window", "early_exit"),
    pytest.param("gemma2", "draft_model", marks=pytest.mark.slow),
])
def test_speculative_decoding_through_a_ring_rejects_drafts_and_keeps_the_text(kind, drafter, pairs, registry,
                                                                              expected, tmp_path):
    """Rejected drafts overwrite ring rows whose positions every later query's window has left. The
    drafts: the target's first layer, or a random windowed Mistral (Gemma's tied embeddings make a
    random Gemma echo its input, which any such draft would guess); the draft's own cache keeps every
    position (a session feeds whole prompts in one step)."""
    model, _ = pairs(kind)
    drafts = ({"drafter": "early_exit", "exit_layer": 1} if drafter == "early_exit" else
              {"drafter": "draft_model",
               "draft_model": str(save_hf(build_hf("mistral-window", seed=1), tmp_path, sharded=False))})
    spec = {"kv_cache": "contiguous", "attention": "naive", "scheduler": CHUNKED,
            "decoding": {"name": "speculative", "k": 3, **drafts}}
    built = build(registry, model, spec, max_num_batched_tokens=8)
    assert ring_of(built) == WINDOW - 1 + 8
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected(kind)
    stats = built.engine.decoding.stats()
    assert 0 < stats["proposed_tokens"] and stats["accepted_tokens"] < stats["proposed_tokens"], stats   # rejected


def test_a_step_feeding_more_than_the_ring_was_sized_for_is_refused(pairs, registry):
    model, _ = pairs("gemma2")
    built = build(registry, model, {"kv_cache": "contiguous", "attention": "naive"}, max_num_batched_tokens=8)
    seq = Sequence(Request(0, tuple(random_prompt(12)), max_new_tokens=1))
    seq.start()
    assert built.engine.runner.kv_cache.allocate(seq, 12)
    with pytest.raises(Exception, match="feeds 12 tokens in one step, more than the 8"):
        built.engine.runner.forward(Batch([seq], [12]))


# -- replayed decode steps ---------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_replayed_decode_steps_through_a_ring_give_the_eager_tokens(attention, pairs, registry, expected):
    """CUDA graphs emulated on the CPU (tests/test_graphs.py): a replay reads its lengths from
    kv_lens_t alone, its ring rows' positions too."""
    model, _ = pairs("gemma2")
    built = build(registry, model, {"kv_cache": "contiguous", "attention": attention, "scheduler": CHUNKED}, 8)
    graphs = emulate_graphs(built)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("gemma2")
    assert graphs.disabled is None, graphs.disabled
    assert graphs.num_replays >= 1


@pytest.mark.slow        # torch.compile
def test_compiled_decode_on_the_cpu_through_a_ring_gives_transformers_tokens(pairs, registry, expected):
    model, _ = pairs("gemma2")
    built = build(registry, model, {"kv_cache": "contiguous", "attention": "sdpa", "scheduler": CHUNKED}, 8,
                  graphs=True)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("gemma2")
    assert built.stats()["engine.graphs"] == "compile"


def test_a_ring_view_is_checked_against_its_ring():
    from ablate.api.kv import view_problem
    spec = KVSpec(1, 2, 16, 16, torch.float32, torch.device("cpu"), 1, MAX_SEQ_LEN)
    step = make_step([1], [30])
    k = torch.zeros(1, 10, 2, 16)
    assert view_problem(PaddedKV(k, k, ring=10), step, spec) is None
    assert "ring of 12" in view_problem(PaddedKV(k, k, ring=12), step, spec)
    assert "hold 10 keys" in view_problem(PaddedKV(k, k), step, spec)


def test_an_arms_perplexity_with_a_context_longer_than_its_steps_runs_through_a_ring(pairs, registry):
    """The quality check feeds its whole context in one step: the arm's cache is built for that step,
    and the ring that later tokens go through gives transformers' perplexity."""
    from ablate.experiment.arm_run import arm_perplexity
    model, hf = pairs("gemma2")
    text = random_prompt(48, seed=4)
    arm = resolve_arm("windowed", {"kv_cache": "contiguous", "attention": "naive"}, baseline_configs(registry),
                      registry)
    ours = arm_perplexity(arm, model, text, 20, EngineConfig(max_num_seqs=1, max_num_batched_tokens=4), registry)
    logits = hf_logits(hf)(text)[19:-1]                                          # rows predicting 20 .. 47
    expected = torch.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(text[20:]))).item()
    assert ours == pytest.approx(expected, rel=1e-4)


@dataclass
class MaskByRowConfig(NaiveAttentionConfig):
    name: str = "mask_by_row"


class MaskByRow(NaiveAttention):
    """A third party's windowed attention from before rings: its mask reads rows as positions."""

    name = "mask_by_row"
    config_class = MaskByRowConfig
    reads_key_rings = False

    def __call__(self, q, view, step, layer=None):
        assert view.ring == 0, "handed a ring it cannot mask"
        return super().__call__(q, view, step, layer)


def test_an_attention_plugin_that_does_not_read_rings_gets_every_position(pairs, registry, expected):
    model, _ = pairs("gemma2")
    built = build(registry.with_plugins(MaskByRow), model,
                  {"kv_cache": "contiguous", "attention": "mask_by_row", "scheduler": CHUNKED}, 8)
    assert ring_of(built) == 0
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("gemma2")


@pytest.mark.parametrize("window_layers", [None, [0, 2], [3], []])
def test_the_cost_model_counts_the_keys_each_layer_sees(window_layers):
    """The roofline's FLOPs and bytes (ablate.analysis.analytic) against a count query by query: a
    windowed layer's query at position p sees min(p + 1, W) keys, and a step reads, of the keys before
    it, those its first query's window reaches (the union of its queries' windows)."""
    import random

    from ablate.analysis.analytic import CostModel
    from ablate.model.presets import preset

    cfg = preset("tiny", n_layers=4, sliding_window=5, window_layers=window_layers)
    model = CostModel(cfg, keeps_kv=True)
    rng = random.Random(0)
    for _ in range(50):
        query_lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        context_lens = [q + rng.randint(0, 20) for q in query_lens]
        attended = history = 0
        for layer in range(cfg.n_layers):
            window = cfg.layer_window(layer) or 10**9
            for q, c in zip(query_lens, context_lens):
                seen = {j for p in range(c - q, c) for j in range(max(0, p - window + 1), p + 1)}
                attended += sum(min(p + 1, window) for p in range(c - q, c))
                history += sum(1 for j in seen if j < c - q)
        cost = model.step(query_lens, context_lens, num_logits=len(query_lens))
        tokens = sum(query_lens)
        assert cost.flops == (2 * model.linear_params * tokens + 4 * cfg.n_heads * cfg.head_dim * attended
                              + 2 * model.head_params * len(query_lens))
        assert cost.bytes == pytest.approx(model.weight_bytes + (history / cfg.n_layers + tokens) * model.kv_token_bytes)
