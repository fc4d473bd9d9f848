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

Requests differ in their sampling parameters (SAMPLING), so that every batch mixes greedy requests
with sampled ones at several temperatures and top_p below 1, each token tested against its own
request's distribution: a decoder that ignores a request's temperature or top_p, or samples a
greedy request because its batch mates sample, fails. Greedy requests must emit the argmax.

A random model's text rarely repeats, so drafts would rarely be proposed or accepted and a biased
acceptance rule would hide. The test therefore samples from a cyclic model (`cyclic_model`): a
Llama whose next token is the current one's successor in a short cycle with probability ~0.6 at
temperature 1, anything else otherwise. Its text repeats the cycle with random breaks, so a
lookup or a model drafter proposes drafts that are right about as often as not, and both the
acceptance and the rejection branches of a rule run hundreds of times.
"""
from __future__ import annotations

import math

import torch

from ablate.api.context import EngineConfig
from ablate.api.plugin import PluginError, Slot
from ablate.api.sampling import probabilities
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.registry import Registry
from ablate.measure.quality import sequence_logits
from ablate.model.llama import LlamaModel
from ablate.testing.coverage import Coverage, CoverageHook
from ablate.testing.scenarios import ConformanceError, arm_spec, build, max_len

# (temperature, top_p) of the requests, cycled (engine batches of 8 hold one of each). The cyclic
# model gives the successor probability 0.99 at temperature 0.6, 0.61 at 1 and 0.28 at 1.3, the other
# 255 tokens tie for the rest. top_p below the successor's probability keeps it alone (a top_p
# cutting among tied tokens would depend on how a sort orders ties), so a decoder ignoring top_p
# emits tokens of probability 0. Half the requests sample at 1, where drafts are rejected often
# enough for a biased rejection rule to show
SAMPLING = [(1.0, 1.0), (0.0, 1.0), (1.0, 1.0), (0.6, 1.0), (1.0, 1.0), (1.3, 1.0), (1.0, 1.0), (1.0, 0.5)]
SAMPLING_STATES = ("mixed_batches", "several_temperatures", "top_p_below_1")
NUM_REQUESTS = 64
LENGTHS = [(12, 18), (18, 14), (9, 20), (15, 16)]   # cycled over the requests
CYCLE = 8                   # the cyclic model's cycle: tokens 0 .. CYCLE-1
SUCCESSOR_LOGIT = 6.0       # logit of the successor over the rest (0): p ~ 0.6 against 255 others
Z_LIMIT = 4.0
KS_P_LIMIT = 1e-4


@torch.no_grad()
def cyclic_model(base: LlamaModel, cycle: int = CYCLE, successor_logit: float = SUCCESSOR_LOGIT) -> LlamaModel:
    """A copy of `base` (random tiny weights) turned into a bigram model: attention and MLP outputs
    zeroed, so the final hidden state is the normalised embedding of the current token x; embedding
    rows one-hot on dim x mod d (scaled so RMSNorm keeps them), and LM-head rows such that
    logit(y | x) = successor_logit when y = (x + 1) mod cycle, else 0."""
    device = next(base.parameters()).device
    model = LlamaModel.random(base.config, device)
    d, vocab = model.config.d_model, model.config.vocab_size
    for layer in model.layers:
        layer.attn.wo.weight.zero_()
        layer.mlp.w_down.weight.zero_()
    embed = torch.zeros(vocab, d, device=device)
    tokens = torch.arange(vocab, device=device)
    embed[tokens, tokens % d] = d ** 0.5                                       # RMS 1: the final norm keeps it
    head = torch.zeros(vocab, d, device=device)
    for x in range(d):                                                         # tokens sharing dim x mod d
        head[(x + 1) % cycle, x] = successor_logit / d ** 0.5
    model.embed.weight.copy_(embed.to(model.embed.weight.dtype))
    model.lm_head.weight.copy_(head.to(model.lm_head.weight.dtype))
    model.norm.weight.fill_(1.0)
    return model


def cyclic_prompts(num: int, lengths: list[tuple[int, int]], vocab_size: int, seed: int = 7
                   ) -> list[tuple[tuple[int, ...], int]]:
    """Prompts that run round the cycle from a random start, with a few random tokens."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p, n = lengths[i % len(lengths)]
        # host-side: token ids drawn from a seeded CPU generator
        start = int(torch.randint(CYCLE, (1,), generator=rng, device="cpu"))
        noise = torch.rand(p, generator=rng, device="cpu") < 0.15
        prompt = [(start + j) % CYCLE if not noise[j]
                  else int(torch.randint(vocab_size, (1,), generator=rng, device="cpu"))
                  for j in range(p)]
        out.append((tuple(prompt), n))
    return out


def ks_p_value(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov test of u against U(0, 1): the asymptotic p-value (Stephens' correction)."""
    n = u.numel()
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64, device=s.device)
    d = float(torch.maximum(i / n - s, s - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, p))


def sampling_statistics(model: LlamaModel, seqs, seed: int = 0) -> dict[tuple[float, float], tuple[float, float, int]]:
    """Per sampling setting (temperature, top_p): (z, KS p-value, tokens) of the sampled requests'
    tokens against the model's exact distributions under that setting. Tested apart, so that errors
    of opposite sign at two temperatures cannot cancel; z is 0 for a setting that leaves one token
    possible (no variance: a token of probability 0 is refused instead). A greedy request's tokens
    must be the argmax."""
    gen = torch.Generator().manual_seed(seed)
    groups: dict[tuple[float, float], list[list[torch.Tensor]]] = {}     # setting -> [ll, m, v, pit] per request
    for seq in seqs:
        params = seq.request.sampling
        p0, out = seq.num_prompt_tokens, seq.output_token_ids
        logits = sequence_logits(model, seq.token_ids[:-1])[p0 - 1:]           # (n, V): row t predicts out[t]
        if params.is_greedy:
            best = logits.argmax(-1).tolist()
            if out != best:
                t = next(i for i, (a, b) in enumerate(zip(out, best)) if a != b)
                raise ValueError(f"greedy request {seq.seq_id} emitted token {out[t]} at output position {t} "
                                 f"where the target's argmax is {best[t]}")
            continue
        # the statistics on the CPU, where the seeded generator draws the randomised PIT
        probs = probabilities(logits, params).double().cpu()                    # (n, V)
        x = torch.tensor(out, device="cpu")
        p_x = probs[torch.arange(len(out), device="cpu"), x]                    # (n,)
        if bool((p_x == 0).any()):
            raise ValueError(f"request {seq.seq_id} (temperature {params.temperature}, top_p {params.top_p}) "
                             "emitted a token the target gives probability 0")
        logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
        m = (probs * logp).sum(-1)
        ranked, _ = probs.sort(dim=-1, descending=True)
        above = (ranked * (ranked > p_x[:, None])).sum(-1)                      # mass of strictly likelier tokens
        ties = (probs == p_x[:, None]).sum(-1)                                  # x shares its rank with ties
        pit = above + torch.rand(len(out), generator=gen, dtype=torch.float64, device="cpu") * p_x * ties
        group = groups.setdefault((params.temperature, params.top_p), [[], [], [], []])
        for parts, value in zip(group, (p_x.log(), m, (probs * logp ** 2).sum(-1) - m ** 2, pit)):
            parts.append(value)
    out = {}
    for setting, parts in sorted(groups.items()):
        ll, m, v, pit = (torch.cat(p) for p in parts)
        z = float((ll - m).sum() / v.sum().sqrt()) if float(v.sum()) > 1e-12 else 0.0
        out[setting] = (z, ks_p_value(pit), ll.numel())
    return out


def sampled_requests(vocab_size: int) -> list[Request]:
    return [Request(i, prompt, n, SamplingParams(*SAMPLING[i % len(SAMPLING)], seed=1000 + i))
            for i, (prompt, n) in enumerate(cyclic_prompts(NUM_REQUESTS, LENGTHS, vocab_size))]


def check_sampling(registry: Registry, slot: Slot, name: str, model: LlamaModel
                   ) -> tuple[tuple[float, float, int], Coverage] | None:
    """Decoding plugins: (z, KS p-value, tokens) of a passing test and what its run covered; None for
    the other slots."""
    if slot is not Slot.DECODING:
        return None
    plugin = f"{slot.value}={name}"
    model = cyclic_model(model)
    requests = sampled_requests(model.config.vocab_size)
    hooks: list[CoverageHook] = []
    built = build(registry, arm_spec(registry, slot, name), model, EngineConfig(max_num_seqs=8), max_len(requests),
                  lambda kv_cache: hooks.append(CoverageHook(kv_cache)) or hooks)
    try:
        seqs = built.engine.run(requests)
    except PluginError as err:
        raise ConformanceError(f"{plugin} fails the kit on sampled requests: {err}") from err
    finally:
        built.close()
    coverage = hooks[0].coverage
    if missing := coverage.missing(SAMPLING_STATES):
        raise ConformanceError(f"{plugin} never reached what the sampling scenario exists to check: "
                               f"{'; '.join(missing)}")
    try:
        by_setting = sampling_statistics(model, seqs)
    except ValueError as err:
        raise ConformanceError(f"{plugin} does not sample from the target's distribution: {err}") from err
    for (temperature, top_p), (z, ks_p, n) in by_setting.items():
        if abs(z) > Z_LIMIT or ks_p < KS_P_LIMIT:
            raise ConformanceError(
                f"{plugin} does not sample from the target's distribution: over {n} tokens sampled at temperature "
                f"{temperature:g}, top_p {top_p:g} the log-likelihood z = {z:+.2f} (limit {Z_LIMIT}) and the KS "
                f"p-value of the randomized PIT = {ks_p:.2g} (limit {KS_P_LIMIT:g}); an exact sampler gives |z| < "
                f"{Z_LIMIT} and p > {KS_P_LIMIT:g} all but ~1e-4 of the time in each of the {len(by_setting)} settings")
    worst_z = max((z for z, _, _ in by_setting.values()), key=abs)
    worst_p = min(p for _, p, _ in by_setting.values())
    return (worst_z, worst_p, sum(n for _, _, n in by_setting.values())), coverage
