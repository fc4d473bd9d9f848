"""Turning logits into tokens: greedy, or seeded temperature / top-p sampling."""
from __future__ import annotations

import torch

from ablate.api.sequence import SamplingParams, Sequence


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (N, V) -> the distribution sampling draws from (N, V), fp32.

    softmax(logits / T), then top-p keeps the smallest set of most likely tokens whose mass reaches
    p and renormalises. Greedy is the limit T -> 0: a one-hot on the argmax.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs        # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy(logits: torch.Tensor) -> list[int]:
    """logits (N, V) -> each row's argmax (the first, on ties), as host ints: one sync on a GPU. On the
    CPU through numpy, whose argmax is vectorised: torch's CPU argmax reads the row ~10-20x slower, and
    for a 49k vocabulary it would be most of a decode step's host time (benchmarks/host_overhead.py)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(-1)).tolist()   # tolist: the GPU path's one sync
    return logits.argmax(-1).tolist()


class Sampler:
    """One generator per sequence, seeded from its request: tokens do not depend on batch mates."""

    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq: Sequence) -> torch.Generator:
        if seq.seq_id not in self._generators:
            seed = seq.request.sampling.seed
            if seed is None:
                seed = self.default_seed * 1_000_003 + seq.seq_id
            self._generators[seq.seq_id] = torch.Generator().manual_seed(seed)
        return self._generators[seq.seq_id]

    def draw(self, probs: torch.Tensor, seq: Sequence) -> int:
        """One token from a distribution probs (V,)."""
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator(seq)))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits (N, V), one row per sequence -> one token each."""
        if all(s.request.sampling.is_greedy for s in seqs):
            return greedy(logits)                                 # one op (and one sync) for the batch
        tokens = []
        for row, seq in zip(logits, seqs):
            params = seq.request.sampling
            if params.is_greedy:
                tokens.append(greedy(row[None])[0])
            else:
                tokens.append(self.draw(probabilities(row[None], params)[0], seq))
        return tokens
