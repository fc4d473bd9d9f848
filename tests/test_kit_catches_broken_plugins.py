"""The conformance kit's power: every deliberately broken plugin (broken_plugins.py: a correct
built-in with one bug) fails it, with a message that names the plugin and the rule it breaks; the
correct plugins they are made from pass it (test_conformance.py)."""
from __future__ import annotations

import pytest

from ablate.testing import ConformanceError, check_plugin
from broken_plugins import (BiasedSpeculative, DropsArrivals, FirstLayerOnly, ForgetsDecodeTokens, IgnoresMaxNumSeqs,
                            LateWrite, NeverFrees, NeverReleases, ReservedLies, ShortView, Starves, SwapsRowsExact,
                            SwapsRowsLossy, UsedLies, WrongGreedyToken)

# broken plugin -> what the kit's message must say (the rule)
EXPECTED = {
    LateWrite: "differ from the baseline's greedy tokens",
    ShortView: r"short_view\.view: layer 0: PaddedKV rows hold 16 keys but a sequence of this step has 17",
    ForgetsDecodeTokens: "differ from the baseline's greedy tokens",
    FirstLayerOnly: "differ from the baseline's greedy tokens",
    SwapsRowsExact: "differ from the baseline's greedy tokens",
    SwapsRowsLossy: "breaks batch invariance",
    NeverFrees: r"never_frees\.free: reports 3 sequences admitted but only 0 were not released",
    ReservedLies: r"bytes_used\(\) \d+ exceeds bytes_reserved\(\) 0",
    UsedLies: r"bytes_used\(\) \d+ differs from the committed tokens x bytes_per_token",
    NeverReleases: r"never_releases\.next_batch: .* finished but still hold it \(finish_step must release them\)",
    IgnoresMaxNumSeqs: r"ignores_max_num_seqs\.next_batch: a batch of 6 sequences exceeds engine\.max_num_seqs=3",
    DropsArrivals: r"drops_arrivals\.has_unfinished: returned False while sequences \[2, 5\] never finished",
    Starves: r"starves\.next_batch: returns nothing while sequences \[0\] wait and the empty KV cache",
    WrongGreedyToken: "1 of 6 requests differ from the baseline's greedy tokens",
    BiasedSpeculative: "does not sample from the target's distribution",
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
