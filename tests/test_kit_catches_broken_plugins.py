"""The conformance kit's power: every deliberately broken plugin (broken_plugins.py: a correct
built-in with one bug) fails it, with a message that names the plugin and the rule it breaks; the
correct plugins they are made from pass it (test_conformance.py)."""
from __future__ import annotations

import pytest

from ablate.api.plugin import Slot
from ablate.testing import ConformanceError, check_plugin
from ablate.testing.run_checks import check_runs
from ablate.testing.sampling import check_sampling
from ablate.testing.scenarios import RAGGED, ragged_requests
from broken_plugins import (AdmitsTwice, BiasedSpeculative, ClaimsPreemptedCached, CompressedIgnoresBudget,
                            DropsArrivals, FirstLayerOnly, ForgetsDecodeTokens, HalfBytesPerToken, IgnoresMaxNumSeqs,
                            IgnoresTemperature, IgnoresTopP, LateWrite, LogitsByBatchIndex, NeverFrees, NeverReleases,
                            NeverResumes, OneAtATime, ReservedLies, ScalesKInPlace, ShortView, SlotsOffByOne, Starves,
                            SwapsRowsExact, SwapsRowsLossy, UsedLies, WrongGreedyToken, ZeroBytesPerToken)

# broken plugin -> what the kit's message must say (the rule)
EXPECTED = {
    LateWrite: "differ from the baseline's greedy tokens",
    ShortView: r"short_view\.view: layer 0: PaddedKV rows hold 16 keys but a sequence of this step has 17",
    ForgetsDecodeTokens: "differ from the baseline's greedy tokens",
    FirstLayerOnly: "differ from the baseline's greedy tokens",
    SwapsRowsExact: "differ from the baseline's greedy tokens",
    SwapsRowsLossy: "breaks batch invariance",
    NeverFrees: r"never_frees\.free: reports 4 sequences admitted but only 0 were not released",
    ReservedLies: r"bytes_used\(\) \d+ exceeds bytes_reserved\(\) 0",
    UsedLies: r"bytes_used\(\) \d+ differs from the committed tokens x bytes_per_token",
    NeverReleases: r"never_releases\.next_batch: .* finished but still hold it \(finish_step must release them\)",
    IgnoresMaxNumSeqs: r"ignores_max_num_seqs\.next_batch: a batch of 6 sequences exceeds engine\.max_num_seqs=4",
    DropsArrivals: r"drops_arrivals\.has_unfinished: returned False while sequences \[2, 5\] never finished",
    Starves: r"starves\.next_batch: returns nothing while sequences \[0\] wait and the empty KV cache",
    WrongGreedyToken: "1 of 6 requests differ from the baseline's greedy tokens",
    BiasedSpeculative: "does not sample from the target's distribution",
    # caught only once a scenario reaches the state it exists for (ablate/testing/coverage.py)
    NeverResumes: r"never_resumes\.has_unfinished: returned False while sequences \[\d+(, \d+)*\] never finished",
    AdmitsTwice: r"admits_twice\.admit: sequence \d+ is running, not waiting",
    ClaimsPreemptedCached: (r"scheduler=claims_preempted_cached\.next_batch gave kv_cache=paged\.reserve an input it "
                            r"refused \(ValueError: .*cached tokens"),
    OneAtATime: r"never reached what the 'preempting' scenario .* exists to check: the KV cache never refused room",
    IgnoresTemperature: r"does not sample from the target's distribution: over \d+ tokens sampled at temperature 0\.6",
    IgnoresTopP: r"\(temperature 1\.0, top_p 0\.5\) emitted a token the target gives probability 0",
    LogitsByBatchIndex: r"logits_by_batch_index\.step: IndexError",
    ScalesKInPlace: r"edits the K/V its view hands it .*: K of layer 0 .* changed after it was written",
    ZeroBytesPerToken: "reports bytes_per_token = 0, but it keeps K/V",
    HalfBytesPerToken: r"turned \d+ bytes of its storage nonzero, \d+ per token, but bytes_per_token is \d+",
    CompressedIgnoresBudget: r"bytes_reserved\(\) \d+ exceeds kv_cache\.budget_bytes=\d+",
    SlotsOffByOne: r"slots_off_by_one paged_slots\(step\) named rows of layer 0's k pool that do not hold the k",
}


@pytest.fixture(scope="module")
def registry(ablate_registry):
    return ablate_registry.with_plugins(*EXPECTED)


@pytest.mark.parametrize("broken", list(EXPECTED), ids=[cls.name for cls in EXPECTED])
def test_the_kit_fails_a_broken_plugin_naming_it_and_the_rule(broken, registry, ablate_tiny_model):
    with pytest.raises(ConformanceError, match=EXPECTED[broken]) as err:
        check_plugin(broken.slot, broken.name, registry, ablate_tiny_model)
    assert str(err.value).startswith(f"{broken.slot.value}={broken.name} ")


def test_a_plugin_class_that_is_not_a_plugin_is_refused(registry):
    with pytest.raises(ValueError, match="is not a valid plugin"):
        registry.with_plugins(dict)


def test_the_kit_fails_a_sampling_run_that_never_reaches_its_states(ablate_registry, ablate_tiny_model, monkeypatch):
    """The sampling check's states are asserted, not assumed: one setting for every request fails it."""
    monkeypatch.setattr("ablate.testing.sampling.SAMPLING", [(1.0, 1.0)])
    with pytest.raises(ConformanceError, match="no step mixed greedy and sampled requests; requests sampled at fewer "
                                               "than two temperatures; no request sampled with top_p < 1"):
        check_sampling(ablate_registry, Slot.DECODING, "autoregressive", ablate_tiny_model)


def test_the_kit_fails_a_chunked_scenario_that_never_puts_a_silent_chunk_first(ablate_registry, ablate_tiny_model,
                                                                                 monkeypatch):
    """Shortest prompts first, every silent chunk is the newest sequence, last in its batch: the kit says
    so rather than passing a decoder it never showed such a batch."""
    shortest_first = sorted(RAGGED)
    monkeypatch.setattr("ablate.testing.run_checks.ragged_requests",
                        lambda vocab_size: ragged_requests(vocab_size, lengths=shortest_first))
    with pytest.raises(ConformanceError, match="'preempting' scenario .* no step placed a prompt chunk that emits "
                                               "nothing before a sequence that emits"):
        check_runs(ablate_registry, Slot.DECODING, "autoregressive", ablate_tiny_model)
