"""What a decoding plugin runs models with.

`Executor`: the target model, through the arm's KV cache and attention, over one step's batch
(the engine's ModelRunner implements it). `ModelSession`: a second model (a draft model, or a
subset of the target's layers) with a KV cache of its own, for drafting (ctx.model_session).
Neither changes a Sequence: the engine commits what decoding returns, once, after the step.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ablate.api.sequence import Sequence
from ablate.api.step import Batch, StepLogits


class Executor(Protocol):
    device: torch.device

    def forward(self, batch: Batch, draft_tokens: dict[int, list[int]] | None = None) -> StepLogits:
        """Run the target over every sequence's `batch.num_new_tokens` new tokens and, after them, its
        draft tokens (seq_id -> tokens, at most `batch.num_lookahead_tokens[i]` each, only for
        sequences with `batch.emits[i]`). Call it once per step.

        Returns logits for each emitting sequence at its last token and after each of its drafts:
        StepLogits.of(i) is (1 + len(drafts), V); a prompt chunk that stops short of its end gets none.
        Raises PluginError if a sequence is given more drafts than it has room for.
        """
        ...


class ModelSession(Protocol):
    def next_logits(self, seqs: list[Sequence], tails: list[list[int]]) -> tuple[torch.Tensor, list[bool]]:
        """The session's model's logits for the token after seqs[i].token_ids + tails[i], for every i.

        Brings the session's own cache up to date first: it feeds whatever it has not computed (the
        whole prompt the first time, then the tokens the target accepted and emitted since) and
        forgets what no longer matches (drafts the target rejected). Returns logits (B', V) for the
        B' sequences it had room for, and which they are (mask of length len(seqs)).
        """
        ...

    def num_passes(self) -> int:
        """Forward passes run so far."""
        ...

    def bytes_reserved(self) -> int:
        """Bytes its KV cache holds."""
        ...

    def close(self) -> None:
        """Release every sequence it holds and its cache."""
        ...
