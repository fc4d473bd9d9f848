"""scheduler=continuous on the tiny random model: each request's greedy tokens are those it gets alone,
whatever joins or leaves around it (arrival order, chunked prefill, preemption); the textbook case."""
from __future__ import annotations

import random

import pytest

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, Sequence
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.measure.recorder import Recorder
from ablate.workload.requests import WorkloadConfig, textbook_requests

PROMPT_LENS = [3, 30, 11, 17, 6, 24]
MAX_NEW = [12, 4, 15, 7, 2, 10]
MAX_SEQ_LEN = 48
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4     # tiny preset: K and V x layers x kv heads x head dim x fp32


def build(registry, model, spec, *, max_num_seqs: int = 6, max_num_batched_tokens: int = 4096,
          record: bool = False, max_seq_len: int = MAX_SEQ_LEN) -> BuiltArm:
    arm = resolve_arm("test", spec, baseline_configs(registry), registry)
    recorders: list[Recorder] = []

    def hooks(kv_cache):
        if record:
            recorders.append(Recorder(kv_cache))
        return recorders

    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    built = build_arm(arm, model, engine, max_seq_len, registry, hooks)
    built.recorder = recorders[0] if record else None
    return built


def make_requests() -> list[Request]:
    rng = random.Random(0)
    return [Request(i, tuple(rng.randrange(256) for _ in range(p)), n)
            for i, (p, n) in enumerate(zip(PROMPT_LENS, MAX_NEW))]


def serve(built: BuiltArm, requests: list[Request], arrival_steps: list[int]) -> list[Sequence]:
    """The engine loop with arrivals counted in steps, not seconds: request i joins the queue just
    before step arrival_steps[i], so the batch mixes are exactly reproducible."""
    engine, scheduler = built.engine, built.engine.scheduler
    pending = sorted(zip(arrival_steps, range(len(requests))))
    seqs = [Sequence(r) for r in requests]
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            scheduler.add(seqs[pending.pop(0)[1]])
        batch = scheduler.next_batch()
        if batch is not None:
            engine.step(batch)
        elif not pending:
            raise AssertionError("nothing can run and nothing will arrive")
        step += 1
        assert step < 1000, "the scheduler does not make progress"
    return seqs


@pytest.fixture(scope="module")
def alone(ablate_registry, ablate_tiny_model) -> list[list[int]]:
    """Each request's greedy tokens when it runs by itself on the baseline (no cache, static)."""
    return [build(ablate_registry, ablate_tiny_model, {}).engine.run([r])[0].output_token_ids for r in make_requests()]


PAGED = {"name": "paged", "block_size": 4}
TIGHT = {"name": "paged", "block_size": 4, "budget_bytes": 14 * 4 * BYTES_PER_TOKEN}   # 56 slots: preempts
CHUNKED = {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 5}
ARMS = {
    "paged": ({"kv_cache": PAGED, "scheduler": "continuous"}, {}),
    "chunked": ({"kv_cache": PAGED, "scheduler": CHUNKED}, {"max_num_batched_tokens": 9}),
    "preempting": ({"kv_cache": TIGHT, "scheduler": "continuous"}, {}),
    "preempting-chunked": ({"kv_cache": TIGHT, "scheduler": CHUNKED}, {"max_num_batched_tokens": 9}),
    "contiguous-2-slots": ({"kv_cache": "contiguous", "scheduler": "continuous"}, {"max_num_seqs": 2}),
}
SCHEDULES = {
    "all-at-once": [0] * 6,
    "staggered": [0, 3, 3, 8, 9, 20],
    "reversed": [20, 9, 8, 3, 3, 0],
    "shuffled": [5, 0, 14, 2, 2, 7],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arm", ARMS)
def test_each_request_gets_the_tokens_it_gets_alone(arm, schedule, ablate_registry, ablate_tiny_model, alone):
    spec, engine = ARMS[arm]
    built = build(ablate_registry, ablate_tiny_model, spec, **engine)
    seqs = serve(built, make_requests(), SCHEDULES[schedule])
    assert [s.output_token_ids for s in seqs] == alone
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    preemptions = sum(s.num_preemptions for s in seqs)      # counted once, on the sequences
    assert (preemptions > 0) == arm.startswith("preempting")
    assert built.kv_cache.num_seqs_admitted() == 0          # every sequence released its room


def test_iteration_level_scheduling_and_chunked_prefill(ablate_registry, ablate_tiny_model):
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": PAGED, "scheduler": CHUNKED},
                  max_num_batched_tokens=9, record=True)
    seqs = built.engine.run(make_requests())
    steps = built.recorder.steps
    assert max(s.num_tokens for s in steps) <= 9                       # the token budget holds
    assert max(s.num_seqs for s in steps) > 1
    # the 30-token prompt of request 1 is fed in chunks of at most 5 (prefill_chunk): >= 6 steps of prefill
    assert sum(1 for s in steps if s.num_prefill_seqs) >= 30 // 5
    # prefill and decode share steps: some step feeds more sequences than it has prefilling ones
    assert any(0 < s.num_prefill_seqs < s.num_seqs for s in steps)
    assert [s.num_output_tokens for s in seqs] == MAX_NEW


def test_a_waiting_sequence_joins_the_step_after_a_slot_frees(ablate_registry, ablate_tiny_model):
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": PAGED, "scheduler": "continuous"},
                  max_num_seqs=2, record=True)
    built.engine.run(make_requests())
    rec = built.recorder
    finishes = {r.finish for r in rec.requests.values()}
    assert max(s.num_seqs for s in rec.steps) == 2
    for r in list(rec.requests.values())[2:]:      # the first two start at once; each later one...
        before = max(s.end for s in rec.steps if s.end <= r.first_scheduled)
        assert before in finishes                   # ...starts the step right after one finished


def test_a_recompute_longer_than_a_step_is_split_even_without_chunked_prefill(ablate_registry, ablate_tiny_model):
    rng = random.Random(1)
    work = [Request(0, tuple(rng.randrange(256) for _ in range(4)), 30),
            Request(1, tuple(rng.randrange(256) for _ in range(28)), 12)]
    alone = [build(ablate_registry, ablate_tiny_model, {}).engine.run([r])[0].output_token_ids for r in work]
    tight = {"name": "paged", "block_size": 4, "budget_bytes": 12 * 4 * BYTES_PER_TOKEN}   # 48 slots for 34 + 40
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": tight, "scheduler": "continuous"},
                  max_num_batched_tokens=32, record=True)
    seqs = built.engine.run(work)
    assert [s.output_token_ids for s in seqs] == alone
    # request 1 was preempted holding 28 + 9 tokens: more than a step's 32, recomputed in two steps
    assert [s.num_preemptions for s in seqs] == [0, 1]
    assert max(s.num_tokens for s in built.recorder.steps) <= 32


def test_a_prompt_longer_than_a_step_needs_chunked_prefill(ablate_registry, ablate_tiny_model):
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": PAGED, "scheduler": "continuous"},
                  max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="prompt of 30 tokens does not fit one step.*chunked_prefill=true"):
        built.engine.run(make_requests())


@pytest.mark.parametrize("scheduler, order", [
    ("static", "2 1 0 3"),                                   # the 4th waits for the whole batch
    ("continuous", "2 3 1 0"),                               # the 4th takes the slot request 2 frees
    (CHUNKED, "2 3 1 0"),
], ids=["static", "continuous", "continuous-chunked"])
def test_textbook_case_finishes_in_the_expected_order(scheduler, order, ablate_registry, ablate_tiny_model):
    from ablate.measure.metrics import finish_order

    # the textbook's 500, 450 and 100 tokens to go, scaled by 1/10; the 4th generates 10
    work = textbook_requests(WorkloadConfig(arrival="textbook", prompt_len=8, output_len=10), 256,
                             output_lens=(50, 45, 10))
    built = build(ablate_registry, ablate_tiny_model, {"kv_cache": PAGED, "scheduler": scheduler},
                  max_num_seqs=3, record=True, max_seq_len=8 + 50)
    built.engine.run(work)
    rec = built.recorder
    assert finish_order(rec) == order
    fourth_first_token = rec.requests[3].emissions[0][0]
    if scheduler == "static":
        assert fourth_first_token > rec.requests[0].finish
    else:
        assert fourth_first_token < rec.requests[1].finish
        assert rec.requests[3].first_scheduled >= rec.requests[2].finish    # it waited for a free slot


# the same kit call as tests/test_conformance.py::test_plugin_conforms[scheduler=continuous], in the default run
@pytest.mark.slow
def test_conformance(ablate_check_plugin):
    """The kit a third-party scheduler would run (tests/test_conformance.py runs it over every plugin)."""
    ablate_check_plugin("scheduler", "continuous")
