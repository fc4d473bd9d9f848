"""The engine loop, the KV caches, the static scheduler and sampling, on the tiny random model."""
from __future__ import annotations

import pytest
import torch

from ablate.api.sampling import probabilities
from ablate.api.sequence import Request, SamplingParams, Sequence
from ablate.api.step import Batch
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

PROMPT_LENS = [3, 11, 17, 30]
MAX_NEW = [9, 4, 13, 6]          # every sequence finishes at a different step
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def outputs(seqs: list[Sequence]) -> list[list[int]]:
    return [s.output_token_ids for s in seqs]


def kv_bytes_per_token(model: LlamaModel) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, from the model's shape."""
    cfg = model.config
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[cfg.dtype]


@pytest.fixture(scope="module")
def recompute_tokens(build, make_requests) -> list[list[int]]:
    """Greedy tokens of the baseline (kv_cache=none: every step recomputes the whole prefix)."""
    seqs = build({"kv_cache": "none"}).engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    return outputs(seqs)


def test_recompute_baseline_is_a_real_reference(recompute_tokens):
    assert [len(t) for t in recompute_tokens] == MAX_NEW
    # a reference of repeated tokens would let a broken cache pass: the random model must vary
    assert all(len(set(tokens)) > 1 for tokens in recompute_tokens if len(tokens) > 3)
    assert len({tuple(t[:4]) for t in recompute_tokens}) == len(recompute_tokens)


@pytest.mark.parametrize("kv_cache", [
    "contiguous",
    "dynamic",
    {"name": "dynamic", "initial_tokens": 4},   # reallocates during prefill and decode
], ids=["contiguous", "dynamic", "dynamic-growing"])
def test_greedy_tokens_equal_recompute(kv_cache, build, make_requests, recompute_tokens):
    built = build({"kv_cache": kv_cache})
    seqs = built.engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    assert outputs(seqs) == recompute_tokens
    assert [s.finish_reason for s in seqs] == ["length"] * 4
    steps = built.recorder.steps
    # one ragged batch: all four prompts prefilled together, then decoded together
    assert steps[0].num_seqs == 4 and steps[0].num_prefill_seqs == 4
    assert steps[0].num_tokens == sum(PROMPT_LENS)
    # members drop out as they finish: 4 running until the shortest (4 tokens) is done
    assert [s.num_seqs for s in steps] == [sum(m > i for m in MAX_NEW) for i in range(max(MAX_NEW))]
    assert built.kv_cache.bytes_used() == 0       # the finished batch released its room


def test_static_scheduler_runs_a_batch_to_completion(build, make_requests):
    built = build({"kv_cache": "contiguous"}, max_num_seqs=4)
    requests = make_requests([5, 9, 7, 4, 6], [3, 8, 5, 2, 4])
    seqs = built.engine.run(requests)
    assert [s.num_output_tokens for s in seqs] == [3, 8, 5, 2, 4]
    rec = built.recorder
    first_batch_last_finish = max(rec.requests[i].finish for i in range(4))
    fifth_first_token = rec.requests[4].emissions[0][0]
    assert fifth_first_token > first_batch_last_finish
    # the fifth waited although a slot was free after request 3's 2 tokens: nothing joins a batch
    assert [s.num_seqs for s in rec.steps] == [4, 4, 3, 2, 2, 1, 1, 1] + [1] * 4
    assert rec.steps[8].num_prefill_seqs == 1
    # its tokens do not depend on having waited
    alone = build({"kv_cache": "contiguous"}, max_num_seqs=4).engine.run([requests[4]])
    assert alone[0].output_token_ids == seqs[4].output_token_ids


@pytest.mark.parametrize("kv_cache", ["none", "contiguous"])
def test_stop_token_ends_a_sequence(kv_cache, build, make_requests, recompute_tokens):
    reference = recompute_tokens[0]             # request 0: 9 greedy tokens without a stop token
    k = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i])
    stop = reference[k]
    stops = [(stop,), (), (), ()]
    seqs = build({"kv_cache": kv_cache}).engine.run(make_requests(PROMPT_LENS, MAX_NEW, stop_token_ids=stops))
    assert seqs[0].output_token_ids == reference[:k + 1]          # the stop token is kept, nothing after
    assert seqs[0].finish_reason == "stop"
    assert outputs(seqs)[1:] == recompute_tokens[1:]              # batch mates are unaffected
    assert [s.finish_reason for s in seqs[1:]] == ["length"] * 3


def test_probabilities_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    kept = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.9))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    # temperature sharpens: T = 0.5 squares the probabilities before renormalising
    sharp = probabilities(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(sharp, probs**2 / (probs**2).sum())
    greedy = probabilities(logits, SamplingParams())
    assert greedy.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def sampled(seeds: list[int | None]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, top_p=0.9, seed=s) if s is not None else SamplingParams()
            for s in seeds]


def test_sampling_is_reproducible_by_seed(build, make_requests):
    lens, max_new = PROMPT_LENS, [12] * 4

    def run(seeds):
        return outputs(build({"kv_cache": "contiguous"}).engine.run(
            make_requests(lens, max_new, sampling=sampled(seeds))))

    first = run([11, 12, 13, 14])
    assert run([11, 12, 13, 14]) == first
    other = run([21, 22, 23, 24])
    assert all(a != b for a, b in zip(first, other))
    assert all(len(t) == 12 for t in first + other)


def test_sampled_tokens_do_not_depend_on_batch_mates(build, make_requests):
    target = make_requests([17], 12, sampling=sampled([7]), seed=5)[0]
    alone = build({"kv_cache": "contiguous"}).engine.run([target])[0].output_token_ids
    mates = make_requests([3, 30, 11], [5, 12, 2], sampling=sampled([1, 2, None]), seed=9)
    # the target as the fourth member (another request id, another slot, other mates)
    target_in_batch = Request(3, target.prompt_token_ids, 12, target.sampling)
    seqs = build({"kv_cache": "contiguous"}).engine.run([*mates, target_in_batch])
    assert seqs[3].output_token_ids == alone
    # the greedy mate decodes as it would with greedy mates only
    greedy = build({"kv_cache": "none"}).engine.run([Request(0, mates[2].prompt_token_ids, 2)])
    assert seqs[2].output_token_ids == greedy[0].output_token_ids


@pytest.fixture(scope="module")
def models_by_dtype() -> dict[str, LlamaModel]:
    return {d: LlamaModel.random(preset("tiny", dtype=d)) for d in DTYPE_BYTES}


@pytest.mark.parametrize("dtype", list(DTYPE_BYTES))
@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "dynamic"])
def test_dtypes_run_with_every_cache(dtype, kv_cache, models_by_dtype, build, make_requests):
    model = models_by_dtype[dtype]
    assert next(model.parameters()).dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}[dtype]
    built = build({"kv_cache": kv_cache}, model)
    seqs = built.engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    assert [s.num_output_tokens for s in seqs] == MAX_NEW
    assert all(0 <= t < 256 for s in seqs for t in s.output_token_ids)
    if kv_cache != "none":
        assert built.kv_cache.k.dtype == next(model.parameters()).dtype
        assert built.recorder.steps[0].kv_bytes_used == sum(PROMPT_LENS) * kv_bytes_per_token(model)


@pytest.mark.parametrize("dtype", list(DTYPE_BYTES))
def test_kv_bytes_match_the_formula(dtype, models_by_dtype, build, make_requests):
    model = models_by_dtype[dtype]
    per_token = kv_bytes_per_token(model)
    assert per_token == 2 * 2 * 2 * 16 * DTYPE_BYTES[dtype]        # tiny: 2 layers, 2 KV heads of 16
    built = build({"kv_cache": "contiguous"}, model, max_num_seqs=4, max_seq_len=64)
    assert built.kv_cache.spec.bytes_per_token == per_token
    built.engine.run(make_requests(PROMPT_LENS, MAX_NEW))
    steps = built.recorder.steps
    # after step s each sequence holds its prompt + s tokens, until its last fed token
    expected_live = [sum(p + min(s, m - 1) for p, m in zip(PROMPT_LENS, MAX_NEW)) for s in range(len(steps))]
    assert [st.kv_bytes_used for st in steps] == [n * per_token for n in expected_live]
    # contiguous: every slot holds max_seq_len tokens from the start
    assert {st.kv_bytes_reserved for st in steps} == {4 * 64 * per_token}
    assert built.kv_cache.stats()["kv_peak_reserved_bytes"] == 4 * 64 * per_token


def test_recompute_cache_holds_nothing(build, make_requests):
    built = build({"kv_cache": "none"})
    built.engine.run(make_requests(PROMPT_LENS[:2], 3))
    assert {(s.kv_bytes_reserved, s.kv_bytes_used) for s in built.recorder.steps} == {(0, 0)}
    # without a cache every step feeds the whole prefix again
    assert [s.num_tokens for s in built.recorder.steps] == [14, 16, 18]


def test_dynamic_cache_grows_by_doubling(build, make_requests, tiny_model):
    per_token = kv_bytes_per_token(tiny_model)
    built = build({"kv_cache": {"name": "dynamic", "initial_tokens": 8}}, max_num_seqs=4, max_seq_len=64)
    seqs = built.engine.run(make_requests([5], 40))
    assert seqs[0].num_output_tokens == 40
    reserved = [s.kv_bytes_reserved for s in built.recorder.steps]
    assert reserved == sorted(reserved)                              # it only grows
    assert sorted(set(reserved)) == [c * per_token for c in (8, 16, 32, 64)]   # one slot, rows doubling
    # a row is grown exactly when the sequence needs one more token than it holds
    for step, res in zip(built.recorder.steps, reserved):
        assert step.kv_bytes_used <= res


def test_dynamic_reserves_less_than_contiguous_for_short_outputs(build, make_requests, tiny_model):
    per_token = kv_bytes_per_token(tiny_model)
    requests = make_requests([8, 8, 8], 4)
    peaks = {}
    for name in ("contiguous", "dynamic"):
        # the engine allows 512-token sequences; these need 12
        built = build({"kv_cache": name}, max_num_seqs=4, max_seq_len=512)
        seqs = built.engine.run(requests)
        assert [s.num_output_tokens for s in seqs] == [4, 4, 4]
        peaks[name] = max(s.kv_bytes_reserved for s in built.recorder.steps)
    assert peaks["contiguous"] == 4 * 512 * per_token
    assert peaks["dynamic"] == 4 * 64 * per_token            # 3 rows -> 4 (doubling), 64 tokens each
    assert peaks["dynamic"] < peaks["contiguous"]


@pytest.mark.parametrize("kv_cache", ["contiguous", {"name": "dynamic", "initial_tokens": 8}, "paged"],
                         ids=["contiguous", "dynamic", "paged"])
def test_rejected_drafts_are_forgotten_as_if_never_written(kv_cache, build, tiny_model):
    """Feed a prompt plus draft tokens, reject the drafts (the engine commits only the prompt), feed
    the target's token: the logits equal those of a cache that never saw the drafts (the
    speculative-decoding rejection path through the engine's one commit)."""
    per_token = kv_bytes_per_token(tiny_model)
    prompt, draft, token = (17, 4, 99, 250, 3, 61), [8, 120, 33], 42

    built = build({"kv_cache": kv_cache}, max_num_seqs=2, max_seq_len=64, record=False)
    engine, runner, cache = built.engine, built.engine.runner, built.kv_cache
    seq = Sequence(Request(0, prompt, 8))
    seq.start()
    assert cache.allocate(seq, len(prompt), num_lookahead_tokens=len(draft))
    batch = engine.checked(Batch([seq], [len(prompt)]))
    assert batch.num_lookahead_tokens == [len(draft)]       # the room beyond the prompt is the drafts'
    out = runner.forward(batch, {0: draft})
    assert out.rows == [1 + len(draft)] and out.logits.shape == (4, 256)
    assert seq.num_computed_tokens == 0                     # the runner changes no sequence
    engine.commit(batch, {0: [token]})                      # every draft rejected, the target's token emitted
    assert seq.token_ids == [*prompt, token] and seq.num_computed_tokens == len(prompt)
    assert cache.room(seq) == len(prompt) and cache.bytes_used() == len(prompt) * per_token
    assert cache.allocate(seq, 1)
    after_rollback = runner.forward(engine.checked(Batch([seq], [1]))).logits

    fresh = build({"kv_cache": kv_cache}, max_num_seqs=2, max_seq_len=64, record=False)
    ref_seq = Sequence(Request(0, prompt, 8))
    ref_seq.start()
    fresh.kv_cache.allocate(ref_seq, len(prompt))
    batch = fresh.engine.checked(Batch([ref_seq], [len(prompt)]))
    fresh.engine.runner.forward(batch)
    fresh.engine.commit(batch, {0: [token]})
    fresh.kv_cache.allocate(ref_seq, 1)
    never_written = fresh.engine.runner.forward(fresh.engine.checked(Batch([ref_seq], [1]))).logits

    torch.testing.assert_close(after_rollback, never_written, rtol=1e-4, atol=1e-4)
    # the draft's row at the same position saw another token: the comparison can tell them apart
    assert not torch.allclose(out.logits[1], never_written[0], atol=1e-2)
    # and the draft's last row is what feeding prompt + draft as one prompt gives
    whole = build({"kv_cache": "none"}, record=False)
    whole_seq = Sequence(Request(0, prompt + tuple(draft), 8))
    whole_seq.start()
    whole.kv_cache.allocate(whole_seq, len(prompt) + len(draft))
    whole_logits = whole.engine.runner.forward(Batch([whole_seq], [len(prompt) + len(draft)])).logits
    torch.testing.assert_close(out.logits[-1:], whole_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged", "none"])
def test_an_arm_for_longer_sequences_than_the_model_is_refused_naming_both(kv_cache, tiny_model, registry):
    """Positions past model.max_seq_len have no RoPE rows: asking an arm for longer sequences is one
    message naming both lengths and what to change, not an IndexError mid-run."""
    from ablate.api.context import EngineConfig
    from ablate.engine.arm import baseline_configs, build_arm, resolve_arm

    arm = resolve_arm("long", {"kv_cache": kv_cache}, baseline_configs(registry), registry)
    longest = tiny_model.config.max_seq_len
    build_arm(arm, tiny_model, EngineConfig(), longest, registry).close()
    with pytest.raises(ValueError, match=rf"^sequences of up to {longest + 1} tokens cannot run on model 'tiny', "
                                         rf"built for {longest} \(model.max_seq_len\): raise model.max_seq_len"):
        build_arm(arm, tiny_model, EngineConfig(), longest + 1, registry)
