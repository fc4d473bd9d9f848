"""kv_cache=paged keeps only a windowed layer's window: the blocks before it go back to the pool.

Layers are grouped by window (ablate_kv_cache.layer_groups, vLLM's KV-cache groups), each group with a
block table per sequence; a windowed group frees, after each step, the blocks wholly before its next
query's window. Random transformers models with windows of 8 tokens (ablate.testing.hf_models:
every layer windowed, Mistral; alternating, Gemma 2; three of four, Gemma 3), prompts three windows
long and sequences several windows past them: greedy text and logits equal transformers' (and the
contiguous ring cache's), with and without chunked prefill, several sequences at once; the blocks a
sequence holds stay bounded by the window however long it grows, and a budget admits more sequences.
"""
from __future__ import annotations

import pytest
import torch

from ablate.api import BuildContext, KVSpec
from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.teacher import teacher_forced_logits
from ablate.testing.hf_models import hf_logits, random_prompt
from ablate_kv_cache.block_manager import NULL_BLOCK, BlockManager
from ablate_kv_cache.layer_groups import LayerGroup, layer_groups
from ablate_kv_cache.paged import PagedConfig, PagedKVCache
from ablate_kv_cache.paging_model import windowed_reserved_tokens

pytest.importorskip("transformers")

TOL = 1e-3            # max |logit difference| in fp32
WINDOW = 8            # the kinds' sliding_window
BLOCK = 4
MAX_SEQ_LEN = 64
CHUNKED = {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 8}
PROMPTS = [random_prompt(3 * WINDOW, seed=2), random_prompt(3 * WINDOW + 5, seed=3)]
NEW_TOKENS = 16
LONG = 120            # a sequence 15 windows long (the random models take 128 positions)


@pytest.fixture(scope="module")
def expected(hf_greedy):
    """kind -> transformers' greedy continuation of each prompt."""
    return lambda kind: hf_greedy(kind, PROMPTS, NEW_TOKENS)


def build(registry, model, spec: dict, max_num_batched_tokens: int, max_num_seqs: int = 2,
          max_seq_len: int = MAX_SEQ_LEN):
    arm = resolve_arm("windowed", spec, baseline_configs(registry), registry)
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return build_arm(arm, model, engine, max_seq_len, registry)


def paged(**options) -> dict:
    return {"name": "paged", "block_size": BLOCK, **options}


def requests(prompts: list[list[int]], new_tokens: int) -> list[Request]:
    return [Request(i, tuple(p), new_tokens) for i, p in enumerate(prompts)]


def outputs(seqs) -> list[list[int]]:
    return [s.output_token_ids for s in sorted(seqs, key=lambda s: s.request.request_id)]


def num_held(manager: BlockManager, key) -> int:
    """Blocks a table holds: its entries freed before a window (NULL_BLOCK) not counted."""
    return sum(b != NULL_BLOCK for b in manager.block_table(key))


def window_bound(step_tokens: int) -> int:
    """The most blocks a sequence holds in a windowed group: ceil((W - 1 + T) / bs) + 1."""
    return -(-(WINDOW - 1 + step_tokens) // BLOCK) + 1


# -- the groups ------------------------------------------------------------------------------------------

def spec_of(windows: tuple, step_tokens: int = 8) -> KVSpec:
    return KVSpec(len(windows), 2, 16, 16, torch.float32, torch.device("cpu"), max_num_seqs=3,
                  max_seq_len=MAX_SEQ_LEN, windows=windows if any(windows) else (), max_step_tokens=step_tokens)


@pytest.mark.parametrize("windows, groups", [
    ((8, 8, 8, 8), [LayerGroup(8, (0, 1, 2, 3))]),
    ((None,) * 4, [LayerGroup(None, (0, 1, 2, 3))]),
    ((8, None, 8, None), [LayerGroup(8, (0, 2)), LayerGroup(None, (1, 3))]),
    ((8, 8, None, 8), [LayerGroup(8, (0,)), LayerGroup(8, (1,)), LayerGroup(8, (3,)), LayerGroup(None, (2,))]),
    ((8, 16, 8, 16, None, None), [LayerGroup(8, (0, 2)), LayerGroup(16, (1, 3)), LayerGroup(None, (4, 5))]),
], ids=["every-layer", "none", "alternating", "three-to-one", "two-windows"])
def test_layers_are_grouped_by_window_in_groups_of_equal_size(windows, groups):
    assert layer_groups(spec_of(windows)) == groups
    assert layer_groups(spec_of(windows), free_outside_windows=False) == [LayerGroup(None, tuple(range(len(windows))))]


def test_a_window_that_saves_nothing_is_a_full_group():
    # a step may feed the whole sequence: the window's blocks are every block (KVSpec.ring_rows is None)
    assert layer_groups(spec_of((8, None), step_tokens=MAX_SEQ_LEN)) == [LayerGroup(None, (0, 1))]


@pytest.mark.parametrize("windows", [(8, 8, 8, 8), (8, None, 8, None), (8, 8, None, 8)],
                         ids=["every-layer", "alternating", "three-to-one"])
def test_the_pool_holds_each_sequences_window_blocks_and_its_full_blocks(windows):
    """Pool bytes: max_num_seqs x (full groups: every block; windowed: the window bound) blocks of the
    groups' layers, and a block the slots of one group's layers."""
    spec = spec_of(windows)
    cache = PagedKVCache(PagedConfig(block_size=BLOCK), BuildContext(None, spec, EngineConfig(max_num_seqs=3)))
    per_layer_token = 2 * 16 * 2 * 4                                          # heads x (K + V) x fp32
    windowed = sum(w is not None for w in windows)
    layers_per_block = len(cache.groups[0].layers)
    assert cache.block_bytes == BLOCK * layers_per_block * per_layer_token
    held = (windowed * window_bound(8) + (len(windows) - windowed) * MAX_SEQ_LEN // BLOCK) // layers_per_block
    assert cache.manager.num_blocks == 3 * held
    assert cache.pool_bytes() == 3 * held * cache.block_bytes
    assert cache.stats()["kv_block_groups"] == len(cache.groups) > (1 if None in windows else 0)


# -- the block manager's freed entries ---------------------------------------------------------------------

def test_free_before_gives_back_the_blocks_wholly_before_a_position_and_leaves_null_entries():
    manager = BlockManager(num_blocks=10, block_size=4)
    manager.allocate("a", list(range(14)))                  # 4 blocks
    assert manager.free_before("a", 9) == 2                 # blocks 0, 1 end at 8 <= 9; block 2 holds 9
    assert manager.block_table("a")[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in manager.block_table("a")[2:]
    assert num_held(manager, "a") == manager.num_used_blocks == 2
    assert manager.free_before("a", 9) == 0                 # freed once
    manager.check_invariants()
    manager.append("a", 6)                                  # 20 tokens: 5 entries, 3 held
    manager.truncate("a", 15)
    assert manager.num_used_blocks == 2
    manager.check_invariants()
    manager.free("a")
    assert manager.num_free_blocks == 10
    manager.check_invariants()


def test_free_before_refuses_prefix_caching():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    manager.allocate(0, list(range(9)))
    with pytest.raises(RuntimeError, match="prefix caching"):
        manager.free_before(0, 8)


@pytest.mark.parametrize("window, step", [(8, 1), (8, 3), (5, 4), (13, 7)])
def test_the_paging_model_counts_the_blocks_a_windowed_group_holds(window, step):
    """windowed_reserved_tokens(L) is block_size x the blocks the manager holds after committing L tokens."""
    manager = BlockManager(num_blocks=64, block_size=BLOCK)
    manager.allocate(0, [0] * step)
    for length in range(step, 120, step):
        manager.free_before(0, max(0, length - window + 1))
        expected = windowed_reserved_tokens(torch.tensor([length]).numpy(), BLOCK, window)[0]
        assert num_held(manager, 0) * BLOCK == expected, length
        assert num_held(manager, 0) <= -(-(window - 1 + step) // BLOCK) + 1
        manager.append(0, step)


# -- greedy text and logits equal transformers' ----------------------------------------------------------

# kind, attention, max_num_batched_tokens, the scheduler
ENGINE_CASES = [
    pytest.param("mistral-window", "sdpa", 8, CHUNKED, id="mistral-chunked-sdpa"),
    pytest.param("gemma2", "naive", 30, "continuous", id="gemma2-one-step-prefill-naive"),
    pytest.param("gemma3", "paged", 8, CHUNKED, id="gemma3-chunked-paged-attention"),
    pytest.param("mistral-window", "paged", 30, "continuous", id="mistral-one-step-prefill-paged-attention",
                 marks=pytest.mark.slow),
    pytest.param("gemma2", "sdpa", 8, CHUNKED, id="gemma2-chunked-sdpa", marks=pytest.mark.slow),
    pytest.param("gemma3", "naive", 30, "continuous", id="gemma3-one-step-prefill", marks=pytest.mark.slow),
    pytest.param("qwen2-window", "sdpa", 8, CHUNKED, id="qwen2-chunked", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, attention, max_num_batched_tokens, scheduler", ENGINE_CASES)
def test_the_engine_decodes_transformers_greedy_text_while_freeing_blocks(kind, attention, max_num_batched_tokens,
                                                                          scheduler, pairs, ablate_registry, expected):
    """Two sequences of different lengths in one batch, each several windows long: transformers' greedy
    text, the contiguous ring cache's too, while the windowed groups give blocks back."""
    model, _ = pairs(kind)
    spec = {"kv_cache": paged(), "attention": attention, "scheduler": scheduler}
    built = build(ablate_registry, model, spec, max_num_batched_tokens)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected(kind)
    stats = built.engine.runner.kv_cache.stats()
    assert stats["kv_blocks_freed_by_window"] > 0, stats
    ring_spec = spec | {"kv_cache": "contiguous", "attention": "sdpa" if attention == "paged" else attention}
    ring = build(ablate_registry, model, ring_spec, max_num_batched_tokens)
    assert outputs(ring.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected(kind)


@pytest.mark.parametrize("kind", ["gemma2", "mistral-window", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_teacher_forced_logits_through_freed_blocks_match_transformers(kind, pairs, ablate_registry):
    """Two texts prefilled in chunks, then fed token by token past several windows: every row's logits
    within 1e-3 of transformers'."""
    model, hf = pairs(kind)
    texts, prefills = [random_prompt(44, seed=2), random_prompt(37, seed=3)], [3 * WINDOW, 3 * WINDOW + 5]
    built = build(ablate_registry, model, {"kv_cache": paged(), "attention": "sdpa"}, max_num_batched_tokens=29)
    for text, p, ours in zip(texts, prefills, teacher_forced_logits(built.engine.runner, texts, prefills)):
        diff = (ours - hf_logits(hf)(text)[p - 1:-1]).abs().max().item()
        assert diff < TOL, f"max |logit diff| {diff:.2e}"
    assert built.engine.runner.kv_cache.stats()["kv_blocks_freed_by_window"] > 0


# -- what the pool holds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mistral-window", "gemma2"])
def test_the_blocks_held_stay_bounded_by_the_window_as_a_sequence_grows(kind, pairs, ablate_registry):
    """One sequence of 24 prompt tokens grows to 120, 15 windows: a windowed group never holds more
    than ceil((W - 1 + T) / bs) + 1 blocks, a full group every block of the sequence; the bytes held
    and the live bytes are what that many blocks and ModelConfig.kv_bytes_at count."""
    model, _ = pairs(kind)
    cfg = model.config
    built = build(ablate_registry, model, {"kv_cache": paged(), "attention": "sdpa", "scheduler": CHUNKED},
                  max_num_batched_tokens=8, max_num_seqs=1, max_seq_len=LONG)
    cache = built.engine.runner.kv_cache
    manager, windowed = cache.manager, [g for g, group in enumerate(cache.groups) if group.window is not None]
    assert windowed
    commit, most = cache.keep, {}

    def checked_keep(seq, num_tokens):
        commit(seq, num_tokens)
        for g, group in enumerate(cache.groups):
            held = num_held(manager, (seq.seq_id, g))
            most[g] = max(most.get(g, 0), held)
            if group.window is None:
                assert held == -(-num_tokens // BLOCK)
        assert cache.bytes_used() == cfg.kv_bytes_at(num_tokens)
        assert cache.bytes_reserved() == manager.num_used_blocks * cache.block_bytes
        manager.check_invariants()
    cache.keep = checked_keep
    [seq] = built.engine.run([Request(0, tuple(PROMPTS[0]), LONG - len(PROMPTS[0]))])
    assert seq.num_tokens == LONG
    assert all(most[g] <= window_bound(8) for g in windowed), most
    stats = cache.stats()
    full_blocks = -(-(LONG - 1) // BLOCK) * (len(cache.groups) - len(windowed))
    assert stats["kv_blocks_used_peak"] <= len(windowed) * window_bound(8) + full_blocks
    assert stats["kv_blocks_freed_by_window"] >= len(windowed) * (LONG - 1 - WINDOW) // BLOCK - len(windowed)


def test_a_budget_of_a_few_windows_admits_sequences_that_every_block_would_not(pairs, ablate_registry, expected):
    """A budget of two sequences' window blocks (10 of 4 tokens), where one sequence of every block would
    need 16: both sequences run at once, and the text is transformers'."""
    model, _ = pairs("mistral-window")
    block_bytes = BLOCK * model.config.kv_bytes_per_token()
    spec = {"kv_cache": paged(budget_bytes=2 * window_bound(8) * block_bytes), "attention": "sdpa",
            "scheduler": CHUNKED}
    built = build(ablate_registry, model, spec, max_num_batched_tokens=8)
    cache = built.engine.runner.kv_cache
    assert cache.manager.num_blocks == 2 * window_bound(8) < MAX_SEQ_LEN // BLOCK
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("mistral-window")
    stats = cache.stats()
    assert stats["max_seqs_admitted"] == 2 and stats["kv_blocks_used_peak"] <= 2 * window_bound(8), stats
    assert stats["predicted_seqs_admitted"] == 2, stats


def test_sequences_preempted_for_want_of_blocks_are_recomputed_to_transformers_text(pairs, ablate_registry, expected):
    """A budget of one sequence's window blocks and two more: the sequences take blocks from each other
    (preempted, recomputed from their first token), and the text is still transformers'."""
    model, _ = pairs("mistral-window")
    block_bytes = BLOCK * model.config.kv_bytes_per_token()
    spec = {"kv_cache": paged(budget_bytes=(window_bound(8) + 2) * block_bytes), "attention": "sdpa",
            "scheduler": CHUNKED}
    built = build(ablate_registry, model, spec, max_num_batched_tokens=8)
    seqs = built.engine.run(requests(PROMPTS, NEW_TOKENS))
    assert outputs(seqs) == expected("mistral-window")
    assert sum(s.num_preemptions for s in seqs) > 0
    built.engine.runner.kv_cache.manager.check_invariants()


def test_prefix_caching_keeps_every_block_in_one_group(pairs, ablate_registry, expected):
    """A freed block's prefix could not be matched whole: with prefix caching every layer shares one
    table and no block is freed, and the text is still transformers'."""
    model, _ = pairs("gemma2")
    built = build(ablate_registry, model, {"kv_cache": paged(prefix_caching=True), "attention": "sdpa",
                                    "scheduler": CHUNKED}, max_num_batched_tokens=8)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("gemma2")
    stats = built.engine.runner.kv_cache.stats()
    assert stats["kv_block_groups"] == 1 and stats["kv_blocks_freed_by_window"] == 0, stats


# -- replayed decode steps, rejected drafts -------------------------------------------------------------------

def test_replayed_decode_steps_through_freed_blocks_give_the_eager_tokens(pairs, ablate_registry, expected):
    """CUDA graphs emulated on the CPU (tests/test_graphs.py): each group's fixed-width table is in step.plan."""
    from test_graphs import emulate_graphs
    model, _ = pairs("gemma2")
    built = build(ablate_registry, model, {"kv_cache": paged(), "attention": "sdpa", "scheduler": CHUNKED}, 8)
    graphs = emulate_graphs(built)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("gemma2")
    assert graphs.disabled is None, graphs.disabled
    assert graphs.num_replays >= 1


@pytest.mark.slow
def test_speculative_decoding_with_rejected_drafts_through_freed_blocks_keeps_the_text(pairs, ablate_registry, expected):
    model, _ = pairs("mistral-window")
    spec = {"kv_cache": paged(), "attention": "sdpa", "scheduler": CHUNKED,
            "decoding": {"name": "speculative", "k": 3, "drafter": "early_exit", "exit_layer": 1}}
    built = build(ablate_registry, model, spec, max_num_batched_tokens=8)
    assert outputs(built.engine.run(requests(PROMPTS, NEW_TOKENS))) == expected("mistral-window")
    stats = built.engine.decoding.stats()
    assert 0 < stats["proposed_tokens"] and stats["accepted_tokens"] < stats["proposed_tokens"], stats
    assert built.engine.runner.kv_cache.stats()["kv_blocks_freed_by_window"] > 0
