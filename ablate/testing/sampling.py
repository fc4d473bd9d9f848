"""Does a decoding plugin sample from the target's distribution? A statistical test.

Sampled requests (temperature T) run through the plugin; then the target's exact next-token
distribution p_t at every emitted position t is computed by teacher forcing the emitted text
through the bare model. Under "every token is drawn from p_t" (what speculative sampling
guarantees), two statistics are exactly distributed, whatever the drafts were:

- log-likelihood z: l_t = log p_t(x_t) has mean m_t = sum_y p_t(y) log p_t(y) and variance
  v_t = sum_y p_t(y) log^2 p_t(y) - m_t^2, so z = sum_t (l_t - m_t) / sqrt(sum_t v_t) ~ N(0, 1) (a
  martingale CLT). A rule biased towards likely tokens (or drafts) pushes z up; towards unlikely
  ones, down.
- randomized probability integral transform: with the vocabulary sorted by p_t descending and x_t
  at rank r, u_t = P_t(rank < r) + U p_t(x_t), U ~ U(0, 1), is uniform on [0, 1] and independent
  across t; a Kolmogorov-Smirnov test against the uniform catches mass moved between ranks.

The plugin fails when |z| > Z_LIMIT or the KS p-value < KS_P_LIMIT: with seeded requests the test
is deterministic, and a correct sampler is at p ~ 1e-4 away from a false alarm.
"""
from __future__ import annotations

import math

import torch

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sampling import probabilities
from ablate.api.sequence import SamplingParams
from ablate.engine.registry import Registry
from ablate.measure.quality import sequence_logits
from ablate.model.llama import LlamaModel
from ablate.testing.scenarios import ConformanceError, arm_spec, build, max_len, ragged_requests

TEMPERATURE = 0.7
NUM_REQUESTS = 48
LENGTHS = [(12, 10), (18, 8), (9, 12), (15, 10)]   # cycled over the requests
Z_LIMIT = 4.0
KS_P_LIMIT = 1e-4


def ks_p_value(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov test of u against U(0, 1): the asymptotic p-value (Stephens' correction)."""
    n = u.numel()
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - s, s - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, p))


def sampling_statistics(model: LlamaModel, seqs, params: SamplingParams, seed: int = 0) -> tuple[float, float, int]:
    """(z, KS p-value, tokens) of the emitted tokens against the model's exact distributions."""
    gen = torch.Generator().manual_seed(seed)
    lls, means, variances, pits = [], [], [], []
    for seq in seqs:
        p0, out = seq.num_prompt_tokens, seq.output_token_ids
        logits = sequence_logits(model, seq.token_ids[:-1])[p0 - 1:]           # (n, V): row t predicts out[t]
        probs = probabilities(logits, params).double()                          # (n, V)
        x = torch.tensor(out)
        p_x = probs[torch.arange(len(out)), x]                                  # (n,)
        if bool((p_x == 0).any()):
            raise ValueError(f"request {seq.seq_id} emitted a token the target gives probability 0")
        logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
        m = (probs * logp).sum(-1)
        lls.append(p_x.log())
        means.append(m)
        variances.append((probs * logp ** 2).sum(-1) - m ** 2)
        ranked, _ = probs.sort(dim=-1, descending=True)
        above = (ranked * (ranked > p_x[:, None])).sum(-1)                      # mass of strictly likelier tokens
        ties = (probs == p_x[:, None]).sum(-1)                                  # x shares its rank with ties
        pits.append(above + torch.rand(len(out), generator=gen, dtype=torch.float64) * p_x * ties)
    ll, m, v = torch.cat(lls), torch.cat(means), torch.cat(variances)
    z = float((ll - m).sum() / v.sum().sqrt())
    return z, ks_p_value(torch.cat(pits)), ll.numel()


def check_sampling(registry: Registry, slot: Slot, name: str, model: LlamaModel) -> None:
    if slot is not Slot.DECODING:
        return
    plugin = f"{slot.value}={name}"
    params = SamplingParams(temperature=TEMPERATURE)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(NUM_REQUESTS)]
    requests = ragged_requests(model.config.vocab_size, seed=7, lengths=lengths, temperature=TEMPERATURE)
    built = build(registry, arm_spec(registry, slot, name), model, EngineConfig(max_num_seqs=8), max_len(requests))
    try:
        seqs = built.engine.run(requests)
    except PluginError as err:
        raise ConformanceError(f"{plugin} fails the kit on sampled requests: {err}") from err
    finally:
        built.close()
    try:
        z, ks_p, n = sampling_statistics(model, seqs, params)
    except ValueError as err:
        raise ConformanceError(f"{plugin} does not sample from the target's distribution: {err}") from err
    if abs(z) > Z_LIMIT or ks_p < KS_P_LIMIT:
        raise ConformanceError(
            f"{plugin} does not sample from the target's distribution: over {n} sampled tokens (temperature "
            f"{TEMPERATURE}) the log-likelihood z = {z:+.2f} (limit {Z_LIMIT}) and the KS p-value of the "
            f"randomized PIT = {ks_p:.2g} (limit {KS_P_LIMIT:g}); an exact sampler gives |z| < {Z_LIMIT} and p > "
            f"{KS_P_LIMIT:g} all but ~1e-4 of the time")
