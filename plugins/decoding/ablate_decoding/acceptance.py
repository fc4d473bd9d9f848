"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Drafts x_1..x_k were drawn from the drafter's distributions q_1..q_k; one target pass over the
pending token and the k drafts gives p_1..p_{k+1} (p_i: the target's distribution for x_i's position).
For i = 1..k, in order:
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection emit one token from  r_i = max(0, p_i - q_i) / sum_y max(0, p_i(y) - q_i(y))
  and stop;
if all k are accepted, emit one more token from p_{k+1}.

Every emitted token is distributed exactly as p: P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y)
= min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y), since P(reject) = 1 - sum_y min(p(y), q(y))
= sum_y max(0, p(y) - q(y)) is exactly r's normaliser.

A deterministic drafter (n-gram lookup, a greedy draft) has q_i = one-hot(x_i): x_i is accepted with
probability p_i(x_i) and the residual is p_i with x_i removed. A greedy target has p_i = one-hot on its
argmax t_i: x_i is accepted iff x_i = t_i, and the residual is one-hot on t_i -- `accept_greedy`, the
same rule without building the distributions, so greedy output is the target's greedy tokens exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    num_accepted: int      # drafts accepted before the first rejection
    tokens: list[int]      # the accepted drafts, then one token from the target (correction or bonus)


def accept_drafts(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                  generator: torch.Generator) -> Verdict:
    """p (k+1, V) target distributions, drafts (k,), q (k, V) draft distributions or None (one-hot)."""
    # on the CPU, where the request's generator is: k + 1 rows, and the draws stay reproducible by seed
    p = p.cpu()
    k = len(drafts)
    x = torch.tensor(drafts, dtype=torch.long, device="cpu")         # (k,)
    rows = torch.arange(k, device="cpu")
    p_x = p[rows, x]                                                 # (k,) p_i(x_i)
    q_x = q.cpu()[rows, x] if q is not None else torch.ones(k, device="cpu")   # (k,) q_i(x_i)
    u = torch.rand(k, generator=generator, device="cpu")             # (k,) U[0, 1)
    accepted = u * q_x < p_x                                         # u < p/q, without dividing by q
    num_accepted = int(accepted.long().cumprod(0).sum())             # the run of acceptances from the start
    if num_accepted == k:
        dist = p[k]                                                  # all accepted: a bonus token from p_{k+1}
    else:
        i = num_accepted
        if q is not None:
            residual = (p[i] - q.cpu()[i]).clamp_min(0.0)            # max(0, p_i - q_i)
        else:
            residual = p[i].index_fill(0, x[i:i + 1], 0.0)           # p_i without x_i
        # p_i == q_i up to rounding leaves no mass (a rejection that had probability ~0): sample p_i
        dist = residual if float(residual.sum()) > 0 else p[i]
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Verdict(num_accepted, drafts[:num_accepted] + [token])


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> Verdict:
    """The rule for a greedy target: target_tokens (k+1,) are its argmax at each position."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted, drafts[:num_accepted] + [target_tokens[num_accepted]])
