"""The verify-cost measurement (ablate.measure.verify_cost): the pass it times computes what decoding
would, its table has one sane row per k, and the knee follows its definition."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from ablate.measure.hardware import Peaks
from ablate.measure.verify_cost import CachedContext, build_verify_arm, knee, verify_cost
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

# a machine where one token's bytes and FLOPs take alike: the roofline's turn falls inside k = 1..4
PEAKS = Peaks(bandwidth_bytes_s=1e9, flops=2e9, source="config")


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return LlamaModel.random(preset("tiny", init="random", max_seq_len=128))


def ids(model: LlamaModel, n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_the_verify_pass_gives_the_logits_of_one_step_per_token(tiny, kv_cache):
    """Feeding the pending token and k drafts in one pass = feeding them one decode step at a time."""
    tokens = ids(tiny, 30)
    built = build_verify_arm(tiny, 30, kv_cache, "sdpa")
    try:
        with torch.inference_mode():
            ctx = CachedContext(built, tokens[:20], tokens[20])
            drafts = tokens[21:27]                                   # k = 6
            verify, stepwise, step = ctx.verify(drafts), ctx.decode(drafts), ctx.step()
            assert built.kv_cache.num_committed() == {0: 20}       # every call rolled back to the context
            again = ctx.verify(drafts)
            ctx.release()
    finally:
        built.close()
    assert verify.shape == stepwise.shape == (7, tiny.config.vocab_size)
    torch.testing.assert_close(verify, stepwise, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify[:1], step, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, verify)                       # the same state every time
    # the rows differ from one another: a pass that ignored its drafts would repeat row 0
    assert not torch.allclose(verify[0], verify[1])


def test_one_row_per_k_with_positive_finite_ratios_and_a_roofline(tiny):
    frame = verify_cost(tiny, context=16, ks=[3, 1, 2], rounds=3, passes_per_round=1, warmup=1, peaks=PEAKS)
    assert frame["k"].tolist() == [1, 2, 3]
    assert frame["tokens"].tolist() == [2, 3, 4]
    for column in ("verify_ms", "step_ms", "ratio", "ratio_ci_low", "ratio_ci_high", "predicted_verify_ms",
                   "predicted_step_ms", "predicted_ratio"):
        values = frame[column].to_numpy(float)
        assert np.isfinite(values).all() and (values > 0).all(), column
    assert (frame["ratio_ci_low"] <= frame["ratio"]).all() and (frame["ratio"] <= frame["ratio_ci_high"]).all()
    assert (frame["rounds"] == 3).all()
    # the prediction: the step's time is the same for every k, the pass's grows with its tokens
    assert frame["predicted_step_ms"].nunique() == 1
    assert frame["predicted_ratio"].is_monotonic_increasing and frame["predicted_ratio"].iloc[0] >= 1
    assert set(frame["bound"]) <= {"memory", "compute"}


def test_without_peaks_the_prediction_is_left_empty(tiny):
    frame = verify_cost(tiny, context=8, ks=[1], rounds=1, passes_per_round=1, warmup=0, peaks=None)
    assert math.isnan(frame["predicted_ratio"].iloc[0]) and frame["bound"].iloc[0] == ""
    assert frame["ratio"].iloc[0] > 0 and math.isnan(frame["ratio_ci_low"].iloc[0])   # one round: no interval


def frame_of(ratios: list[float], ks: list[int] | None = None) -> pd.DataFrame:
    return pd.DataFrame({"k": ks or list(range(1, len(ratios) + 1)), "ratio": ratios})


@pytest.mark.parametrize("ratios, expected", [
    ([1.01, 1.05, 1.19, 1.3, 1.1], 3),        # the flat run ends at the first ratio above 1.2 ...
    ([1.0, 1.1, 1.2], 3),                      # ... at most 1.2 is within
    ([1.25, 1.1, 1.0], 0),                     # k = 1 already costs more
    ([1.1, math.nan, 1.1], 1),                 # no figure is not flat
])
def test_knee(ratios, expected):
    assert knee(frame_of(ratios)) == expected


def test_knee_reads_k_in_order_and_any_column():
    frame = frame_of([1.5, 1.0, 1.1], ks=[4, 1, 2]).assign(predicted_ratio=[1.0, 1.0, 1.0])
    assert knee(frame) == 2
    assert knee(frame, column="predicted_ratio") == 4
    assert knee(frame, tolerance=1.5) == 4


@pytest.mark.parametrize("call, message", [
    (lambda f: knee(f, tolerance=0.9), "tolerance"),
    (lambda f: knee(f.drop(columns="ratio")), "missing"),
])
def test_knee_refuses_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call(frame_of([1.0]))


@pytest.mark.parametrize("kwargs, message", [
    ({"ks": []}, "ks must be"), ({"ks": [0, 1]}, "ks must be"), ({"context": 0}, "context must be"),
    ({"context": 120, "ks": [16]}, "max_seq_len"), ({"rounds": 0}, "rounds must be"),
    ({"peaks": "measured"}, "peaks must be"),
])
def test_verify_cost_refuses_bad_input(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        verify_cost(tiny, **{"context": 8, "ks": [1], "rounds": 1, "warmup": 0, **kwargs})
