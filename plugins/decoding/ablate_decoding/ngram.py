"""drafter=ngram: prompt lookup. No model: the drafts are text that already appeared.

The last n tokens of prompt + output are searched for earlier in it; the tokens that followed the
most recent earlier occurrence are proposed. n runs from `n_max` down to `n_min` (vLLM's
prompt_lookup_max/min): a long match is the better evidence, a short one still drafts where the
output paraphrases its source and only a word or two in a row agree. Where the output quotes the prompt (editing,
summarising, code) the continuation is often exactly that text. The drafts are deterministic, so
q = one-hot: a draft x is accepted with probability p(x) (greedy: iff it is the target's argmax).
"""
from __future__ import annotations

import torch

from ablate.api import Sequence
from ablate_decoding.drafter import Drafter


def lookup(tokens: list[int], n: int, k: int) -> list[int]:
    """The (up to) k tokens that followed the most recent earlier occurrence of tokens[-n:]."""
    if k <= 0 or len(tokens) <= n:
        return []
    pattern = tokens[-n:]
    last = pattern[-1]
    # an occurrence ending at `end` (exclusive) needs at least one token after it: end < len(tokens)
    for end in range(len(tokens) - 1, n - 1, -1):
        if tokens[end - 1] == last and tokens[end - n:end] == pattern:
            return tokens[end:end + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def draft(self, tokens: list[int], k: int) -> list[int]:
        for n in range(self.n_max, self.n_min - 1, -1):
            if found := lookup(tokens, n, k):
                return found
        return []

    def propose(self, seqs: list[Sequence], num_drafts: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        return [self.draft(seq.token_ids, k) for seq, k in zip(seqs, num_drafts)], [None] * len(seqs)
