"""Closed-loop workloads (workload.arrival=closed): N users, each sending its next request when its
previous one finishes; the ArrivalQueue that releases them, and the engine measuring from the send."""
from __future__ import annotations

import pytest

from ablate.api.sequence import Request
from ablate.engine.hooks import StepHook
from ablate.workload.arrivals import ArrivalQueue
from ablate.workload.requests import WorkloadConfig, make_requests

CLOCK_SLACK_S = 1e-9     # t0 + (finish - t0) may differ from finish in the last bit


def request(request_id: int, arrival_time: float = 0.0, follows: int | None = None) -> Request:
    return Request(request_id, (1, 2, 3), 4, arrival_time=arrival_time, follows=follows)


class InSystem(StepHook):
    """How many requests have arrived and not finished, after every arrival."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.counts: list[int] = []

    def on_arrival(self, seq, at: float) -> None:
        self.live.add(seq.seq_id)
        self.counts.append(len(self.live))

    def on_finish(self, seq, at: float) -> None:
        self.live.discard(seq.seq_id)


def test_closed_workload_assigns_requests_to_users_round_robin():
    cfg = WorkloadConfig(num_requests=7, prompt_len=4, output_len=3, arrival="closed", concurrency=3, think_time_s=0.5)
    requests = make_requests(cfg, vocab_size=64)
    assert [r.follows for r in requests] == [None, None, None, 0, 1, 2, 3]
    assert [r.arrival_time for r in requests] == [0.0] * 3 + [0.5] * 4


@pytest.mark.parametrize("fields, message", [
    ({"arrival": "poisson", "concurrency": 4}, r"workload.concurrency and workload.think_time_s are only read with "
                                               r"workload.arrival=closed, not 'poisson'"),
    ({"arrival": "burst", "think_time_s": 1.0}, r"only read with workload.arrival=closed"),
    ({"arrival": "closed", "concurrency": 0}, r"workload.concurrency must be >= 1, got 0"),
    ({"arrival": "closed", "think_time_s": -1.0}, r"workload.think_time_s must be a finite number >= 0"),
])
def test_closed_loop_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**fields)


def test_the_queue_releases_a_follower_its_think_time_after_the_finish():
    queue = ArrivalQueue([request(0), request(1, 0.5), request(2, 0.25, follows=0), request(3, 0.0, follows=2)])
    assert [(t, r.request_id) for t, r in queue.due(0.1)] == [(0.0, 0)]
    assert queue.next_time() == 0.5 and not queue.empty
    queue.finished(0, 0.3)                                   # request 2 is due at 0.3 + 0.25
    assert queue.next_time() == 0.5
    assert [(t, r.request_id) for t, r in queue.due(0.6)] == [(0.5, 1), (0.55, 2)]
    assert queue.next_time() is None and not queue.empty     # request 3 waits for request 2 to finish
    queue.finished(1, 0.7)                                   # nobody follows request 1
    queue.finished(2, 0.8)
    assert [(t, r.request_id) for t, r in queue.due(0.8)] == [(0.8, 3)]
    assert queue.empty and queue.next_time() is None


def test_timed_arrivals_keep_their_order_and_ties():
    requests = [request(0, 0.3), request(1, 0.1), request(2, 0.1), request(3, 0.0)]
    assert [r.request_id for _, r in ArrivalQueue(requests).due(1.0)] == [3, 1, 2, 0]


@pytest.mark.parametrize("requests, message", [
    ([request(0), request(1, follows=7)], r"request 1 follows request 7, which is not in the workload"),
    ([request(0), request(1, follows=2), request(2, follows=1)], r"requests 1 -> 2 -> 1 follow each other in a cycle"),
    ([request(0), request(0)], r"request id 0 appears twice"),
])
def test_a_workload_that_would_wait_forever_is_refused(requests, message):
    with pytest.raises(ValueError, match=message):
        ArrivalQueue(requests)


def test_a_request_cannot_follow_itself():
    with pytest.raises(ValueError, match=r"request 3: follows must be the id of another request"):
        request(3, follows=3)


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
@pytest.mark.parametrize("think_time_s", [0.0, 0.02])
def test_never_more_requests_in_the_system_than_users(scheduler, think_time_s, build, tiny_model):
    cfg = WorkloadConfig(num_requests=6, prompt_len=5, output_len=6, output_dist="uniform", output_spread=3,
                         arrival="closed", concurrency=2, think_time_s=think_time_s, seed=3)
    requests = make_requests(cfg, vocab_size=tiny_model.config.vocab_size)
    built = build({"kv_cache": "contiguous", "scheduler": scheduler})
    probe = InSystem()
    built.engine.hooks.append(probe)
    seqs = built.engine.run(requests)
    assert [s.num_output_tokens for s in seqs] == [r.max_new_tokens for r in requests]
    assert max(probe.counts) == 2 and len(probe.counts) == 6
    records = built.recorder.requests
    start = records[0].arrival
    assert records[1].arrival == start                        # both users start at once
    for i in range(2, 6):                                     # user i % 2 sends request i after request i - 2
        assert records[i].arrival >= records[i - 2].finish + think_time_s - CLOCK_SLACK_S
        assert records[i].arrival <= records[i - 2].finish + think_time_s + 0.5     # ... and soon after
        assert records[i].emissions[0][0] > records[i].arrival                   # TTFT counts from the send
    spans = sorted((r.arrival, r.finish) for r in records.values())
    for t, _ in spans:       # at every arrival, at most two requests are in the system
        assert sum(a <= t < f - CLOCK_SLACK_S for a, f in spans) <= 2


def test_timed_arrivals_are_recorded_at_their_times(build, tiny_model):
    cfg = WorkloadConfig(num_requests=4, prompt_len=5, output_len=3, arrival="poisson", rate=100.0, seed=1)
    requests = make_requests(cfg, vocab_size=tiny_model.config.vocab_size)
    built = build({"kv_cache": "contiguous"})
    built.engine.run(requests)
    records = built.recorder.requests
    for r in requests:
        assert records[r.request_id].arrival - records[0].arrival == pytest.approx(r.arrival_time, abs=1e-9)


def test_an_endless_think_time_is_refused_before_the_run(build):
    requests = [request(0), request(1, 7200.0, follows=0)]
    with pytest.raises(ValueError, match=r"request 1 waits 7200 s after request 0 finishes .* workload.think_time_s"):
        build({"kv_cache": "contiguous"}).engine.run(requests)
