"""Sampling: speculative decoding leaves the target's output distribution unchanged.

Many seeded samples of one prompt, with a deliberately poor draft (another random model, so that
most drafts are rejected and the residual distribution max(0, p - q) does real work), are compared
with plain autoregressive sampling, position by position: a chi-square test of homogeneity of the
two samples' token counts at output positions 2..4 (position 1 comes from the prefill, before any
draft). Threshold: the chi-square critical value at significance 0.001 per position (Wilson-Hilferty
approximation). Seeds are fixed, so the outcome is deterministic; the wrong-rule test shows the test
has the power to fail.
"""
from __future__ import annotations

import math

import pytest
import torch

import ablate_decoding.speculative as speculative_module
from ablate.api.sequence import Request, SamplingParams
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate_decoding.acceptance import Verdict

VOCAB = 16                  # few categories: frequencies converge with a few thousand samples
NUM_SAMPLES = 1000
POSITIONS = (1, 2, 3)       # output indices tested (0 is the prefill's token)
Z_0001 = 3.0902             # standard normal quantile for significance 0.001 (one-sided)
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def chi2_critical(df: int, z: float = Z_0001) -> float:
    """Wilson-Hilferty: chi2_df quantile ~ df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_homogeneity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Counts a, b (C,) of two samples -> (statistic, degrees of freedom); categories expected fewer
    than 5 times in either sample are pooled into one."""
    n_a, n_b = float(a.sum()), float(b.sum())
    expected_a = (a + b) * n_a / (n_a + n_b)
    expected_b = (a + b) * n_b / (n_a + n_b)
    rare = (expected_a < 5) | (expected_b < 5)
    a = torch.cat([a[~rare], a[rare].sum(0, keepdim=True)]).double()
    b = torch.cat([b[~rare], b[rare].sum(0, keepdim=True)]).double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    expected_a, expected_b = (a + b) * n_a / (n_a + n_b), (a + b) * n_b / (n_a + n_b)
    stat = float(((a - expected_a) ** 2 / expected_a).sum() + ((b - expected_b) ** 2 / expected_b).sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def small_vocab_target() -> LlamaModel:
    return LlamaModel.random(preset("tiny", vocab_size=VOCAB))


def token_counts(built, first_seed: int) -> torch.Tensor:
    """(positions, VOCAB) counts of the tokens emitted at each tested output position."""
    sampling = [SamplingParams(temperature=1.0, seed=first_seed + i) for i in range(NUM_SAMPLES)]
    requests = [Request(i, PROMPT, max(POSITIONS) + 1, s) for i, s in enumerate(sampling)]
    seqs = built.engine.run(requests)
    tokens = torch.tensor([s.output_token_ids for s in seqs])                 # (N, positions)
    return torch.stack([torch.bincount(tokens[:, p], minlength=VOCAB) for p in POSITIONS])


@pytest.fixture(scope="module")
def plain_counts(build, small_vocab_target) -> torch.Tensor:
    return token_counts(build({"kv_cache": "contiguous"}, small_vocab_target, max_num_seqs=500), first_seed=0)


def speculative_counts(build, model, drafter: dict) -> torch.Tensor:
    built = build({"kv_cache": "contiguous", "decoding": {"name": "speculative", "k": 3, **drafter}},
                  model, max_num_seqs=500)
    return token_counts(built, first_seed=1_000_000)     # independent of the plain samples' seeds


POOR_DRAFT = {"drafter": "draft_model", "draft_model": "tiny", "draft_overrides": {"vocab_size": VOCAB, "seed": 1}}


def failing_positions(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    failures = []
    for pos, (ca, cb) in zip(POSITIONS, zip(a, b)):
        stat, df = chi2_homogeneity(ca, cb)
        if stat > chi2_critical(df):
            failures.append(f"position {pos + 1}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})")
    return failures


@pytest.mark.parametrize("drafter", [
    POOR_DRAFT,
    {"drafter": "ngram", "ngram_n": 1},              # deterministic drafts: q one-hot
    {"drafter": "early_exit", "exit_layer": 1},
], ids=["draft_model", "ngram", "early_exit"])
def test_sampling_distribution_is_unchanged(drafter, build, small_vocab_target, plain_counts):
    counts = speculative_counts(build, small_vocab_target, drafter)
    assert failing_positions(counts, plain_counts) == []


def always_accept(p, drafts, q, generator) -> Verdict:
    """Wrong: keep every draft, so the output follows the draft, not the target."""
    return Verdict(len(drafts), drafts + [int(torch.multinomial(p[len(drafts)].cpu(), 1, generator=generator))])


def resample_from_target(p, drafts, q, generator) -> Verdict:
    """Wrong, subtly: the right acceptance test, but a rejection resamples from p instead of the
    residual max(0, p - q), so tokens the draft liked are counted twice."""
    p = p.cpu()
    k = len(drafts)
    x, rows = torch.tensor(drafts, dtype=torch.long), torch.arange(k)
    q_x = q.cpu()[rows, x] if q is not None else torch.ones(k)
    accepted = torch.rand(k, generator=generator) * q_x < p[rows, x]
    a = int(accepted.long().cumprod(0).sum())
    return Verdict(a, drafts[:a] + [int(torch.multinomial(p[a], 1, generator=generator))])


@pytest.mark.parametrize("wrong_rule", [      # a sampling run each (~1.5 s): the first in the default run
    pytest.param(always_accept, id="always_accept"),
    pytest.param(resample_from_target, id="resample_p", marks=pytest.mark.slow)])
def test_the_test_fails_a_wrong_acceptance_rule(wrong_rule, build, small_vocab_target, plain_counts, monkeypatch):
    monkeypatch.setattr(speculative_module, "accept_drafts", wrong_rule)
    counts = speculative_counts(build, small_vocab_target, POOR_DRAFT)
    assert failing_positions(counts, plain_counts) != []


def test_chi2_critical_value():
    # tabulated chi-square quantiles at 0.999: df 5 -> 20.52, df 15 -> 37.70
    assert chi2_critical(5) == pytest.approx(20.52, rel=0.02)
    assert chi2_critical(15) == pytest.approx(37.70, rel=0.01)
