"""Synthetic workloads: seeded, within their caps, with roughly the asked-for means, and checked."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate.experiment.config import build
from ablate.workload.requests import LENGTH_DISTS, WorkloadConfig, make_requests


def lengths(requests) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([len(r.prompt_token_ids) for r in requests]),
            np.array([r.max_new_tokens for r in requests]))


def test_same_seed_same_requests_other_seed_others():
    cfg = WorkloadConfig(num_requests=16, prompt_len=20, prompt_dist="uniform", prompt_spread=10,
                         output_dist="exponential", arrival="poisson", rate=5.0, temperature=0.7, top_p=0.9)
    first = make_requests(cfg, vocab_size=1000)
    assert make_requests(cfg, vocab_size=1000) == first
    other = make_requests(WorkloadConfig(**{**cfg.__dict__, "seed": 1}), vocab_size=1000)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in first]
    assert [r.arrival_time for r in other] != [r.arrival_time for r in first]
    assert [r.request_id for r in first] == list(range(16))
    assert all(0 <= t < 1000 for r in first for t in r.prompt_token_ids)
    # each request carries its own sampling seed, with the workload's temperature and top_p
    assert len({r.sampling.seed for r in first}) == 16
    assert {(r.sampling.temperature, r.sampling.top_p) for r in first} == {(0.7, 0.9)}


def test_fixed_burst_workload():
    requests = make_requests(WorkloadConfig(num_requests=3, prompt_len=7, output_len=5), vocab_size=50)
    assert [(len(r.prompt_token_ids), r.max_new_tokens, r.arrival_time) for r in requests] == [(7, 5, 0.0)] * 3
    assert all(r.sampling.is_greedy for r in requests)


def test_uniform_lengths_stay_in_range_with_the_mean():
    cfg = WorkloadConfig(num_requests=2000, prompt_len=40, prompt_dist="uniform", prompt_spread=10,
                         output_len=30, output_dist="uniform", output_spread=20)
    prompts, outputs = lengths(make_requests(cfg, vocab_size=256))
    assert prompts.min() == 30 and prompts.max() == 50 == cfg.max_prompt_len
    assert outputs.min() == 10 and outputs.max() == 50 == cfg.max_output_len
    assert prompts.mean() == pytest.approx(40, rel=0.03)
    assert outputs.mean() == pytest.approx(30, rel=0.03)


@pytest.mark.parametrize("dist", ["exponential", "lognormal"])
def test_long_tailed_outputs_respect_the_cap_and_the_mean(dist):
    # a cap far in the tail: the mean is roughly the asked-for one (+0.5 from rounding up)
    loose = WorkloadConfig(num_requests=4000, output_len=32, output_dist=dist, output_sigma=0.5, output_len_max=1000)
    _, outputs = lengths(make_requests(loose, vocab_size=256))
    assert outputs.min() >= 1 and outputs.max() <= 1000
    assert outputs.mean() == pytest.approx(32.5, rel=0.06)
    # the default cap is 4 x the mean: the same draws, clipped there
    wide = WorkloadConfig(num_requests=4000, output_len=32, output_dist=dist, output_sigma=1.0, output_len_max=1000)
    capped = WorkloadConfig(num_requests=4000, output_len=32, output_dist=dist, output_sigma=1.0)
    assert capped.max_output_len == 128
    _, uncapped = lengths(make_requests(wide, vocab_size=256))
    _, outputs = lengths(make_requests(capped, vocab_size=256))
    assert (uncapped > 128).any()                   # the cap binds
    np.testing.assert_array_equal(outputs, np.minimum(uncapped, 128))


def test_arrivals():
    burst = make_requests(WorkloadConfig(num_requests=5), vocab_size=10)
    assert [r.arrival_time for r in burst] == [0.0] * 5
    poisson = make_requests(WorkloadConfig(num_requests=3001, arrival="poisson", rate=10.0), vocab_size=10)
    times = np.array([r.arrival_time for r in poisson])
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)            # exponential gaps: CV 1
    bursty = make_requests(WorkloadConfig(num_requests=3001, arrival="gamma", rate=10.0, burstiness=4.0),
                           vocab_size=10)
    gaps = np.diff([r.arrival_time for r in bursty])
    assert gaps.mean() == pytest.approx(0.1, rel=0.15)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)           # CV sqrt(burstiness)


@settings(max_examples=40, deadline=None)
@given(num_requests=st.integers(1, 30), prompt_len=st.integers(2, 60), output_len=st.integers(2, 60),
       output_dist=st.sampled_from(LENGTH_DISTS), spread=st.floats(0.0, 0.99), cap=st.integers(0, 200),
       seed=st.integers(0, 2**31))
def test_lengths_always_within_the_configured_bounds(num_requests, prompt_len, output_len, output_dist, spread,
                                                     cap, seed):
    cfg = WorkloadConfig(num_requests=num_requests, prompt_len=prompt_len, prompt_dist="uniform",
                         prompt_spread=int(spread * (prompt_len - 1)), output_len=output_len,
                         output_dist=output_dist, output_spread=int(spread * (output_len - 1)),
                         output_len_max=cap, arrival="gamma", seed=seed)
    requests = make_requests(cfg, vocab_size=64)
    prompts, outputs = lengths(requests)
    assert len(requests) == num_requests
    assert (prompts >= prompt_len - cfg.prompt_spread).all() and (prompts <= cfg.max_prompt_len).all()
    assert (outputs >= 1).all() and (outputs <= cfg.max_output_len).all()
    arrivals = [r.arrival_time for r in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


@pytest.mark.parametrize("fields, named", [
    ({"num_requests": 0}, "num_requests"),
    ({"prompt_len": 0}, "prompt_len"),
    ({"output_len": -1}, "output_len"),
    ({"prompt_spread": -1}, "prompt_spread"),
    ({"output_spread": -2}, "output_spread"),
    ({"output_len_max": -1}, "output_len_max"),
    ({"prompt_dist": "exponential"}, "prompt_dist"),
    ({"output_dist": "zipf"}, "output_dist"),
    ({"arrival": "uniform"}, "arrival"),
    ({"rate": 0.0}, "rate"),
    ({"burstiness": -1.0}, "burstiness"),
    ({"prompt_dist": "uniform", "prompt_len": 8, "prompt_spread": 8}, "prompt_spread"),
    ({"output_dist": "uniform", "output_len": 8, "output_spread": 8}, "output_spread"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_workload_field_raises_naming_it(fields, named):
    with pytest.raises(ValueError, match=rf"workload\.{named}\b"):
        WorkloadConfig(**fields)


def test_unknown_workload_field_names_it():
    with pytest.raises(ValueError, match=r"workload has no field prompt_length; valid fields: num_requests, "):
        build(WorkloadConfig, {"prompt_length": 8}, "workload")
