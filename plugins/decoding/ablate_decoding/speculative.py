"""decoding=speculative: draft k tokens cheaply, verify them all in one pass of the target.

One step, per sequence of the batch:
  prefilling   feed its prompt (chunk); once the prompt is in, emit its first token (as autoregressive)
  decoding     the drafter proposes up to k tokens x_1..x_k; ONE target pass over the pending token and
               the drafts (every sequence of the batch in the same pass) gives p_1..p_{k+1}; the
               acceptance rule (acceptance.py) keeps a prefix x_1..x_a and adds one target token, so a
               sequence emits 1..k+1 tokens and each sequence accepts its own number.
Then the rejected drafts are rolled back: the sequence counts pending + accepted tokens as computed and
the target's and the drafter's caches are truncated to them, as if the rejected ones were never written.
Greedy requests get exactly the target's greedy tokens; sampled ones the target's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ablate.measure import device as dev
from ablate.api.step import Batch
from ablate.api.context import BuildContext, KVSpec
from ablate.api.slots import Decoding
from ablate.api.plugin import PluginConfig
from ablate.api.sequence import Sequence
from ablate.engine.runner import ModelRunner
from ablate.api.sampling import Sampler, probabilities
from ablate_decoding.acceptance import accept_drafts, accept_greedy
from ablate_decoding.draft_models import (early_exit_layers, layer_skip_layers, layer_subset,
                                          load_draft_model)
from ablate_decoding.drafter import Drafter
from ablate_decoding.model_drafter import ModelDrafter
from ablate_decoding.ngram import NgramDrafter
from ablate_decoding.spec_stats import SpeculativeStats

DRAFTERS = ("draft_model", "ngram", "early_exit", "layer_skip")


@dataclass
class SpeculativeConfig(PluginConfig):
    name: str = "speculative"
    k: int = 4                     # draft tokens proposed per sequence and step (fewer near max_new_tokens)
    drafter: str = "ngram"         # draft_model | ngram | early_exit | layer_skip
    draft_model: str = ""          # draft_model: a model preset name or a checkpoint path, same vocabulary
    # draft_model: model fields set on the draft's config, e.g. {seed: 1} or {init: random}; by
    # default the draft takes the target's init and dtype
    draft_overrides: dict[str, Any] = field(default_factory=dict)
    ngram_n: int = 3               # ngram: the longest run of trailing tokens matched to an earlier occurrence
    ngram_min: int = 1             # ngram: ... and the shortest, tried when no longer run matches
    exit_layer: int = 1            # early_exit: run the target's first N layers, then its norm and head
    skip_every: int = 2            # layer_skip: run the target's layers 0, m, 2m, ... and its last
    seed: int = 0                  # seeds requests that carry no seed of their own

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"decoding.k must be >= 1, got {self.k}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"decoding.drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.drafter == "draft_model" and not self.draft_model:
            raise ValueError("decoding.draft_model must name a model preset or checkpoint path when "
                             "decoding.drafter=draft_model")
        if not isinstance(self.draft_overrides, dict):
            raise ValueError(f"decoding.draft_overrides must be a mapping of model fields, got {self.draft_overrides!r}")
        if not 1 <= self.ngram_min <= self.ngram_n:
            raise ValueError(f"decoding.ngram_n and ngram_min need 1 <= ngram_min <= ngram_n, "
                             f"got ngram_n={self.ngram_n}, ngram_min={self.ngram_min}")
        if self.exit_layer < 1:
            raise ValueError(f"decoding.exit_layer must be >= 1, got {self.exit_layer}")
        if self.skip_every < 1:
            raise ValueError(f"decoding.skip_every must be >= 1, got {self.skip_every}")


def make_drafter(config: SpeculativeConfig, ctx: BuildContext, sampler: Sampler) -> Drafter:
    if config.drafter == "ngram":
        return NgramDrafter(config.ngram_n, config.ngram_min)
    target = ctx.model
    n = target.config.n_layers
    if config.drafter == "draft_model":
        model = load_draft_model(config.draft_model, target, config.draft_overrides)
    elif config.drafter == "early_exit":
        model = layer_subset(target, early_exit_layers(n, config.exit_layer), f"exit@{config.exit_layer}")
    else:
        model = layer_subset(target, layer_skip_layers(n, config.skip_every), f"every{config.skip_every}")
    # the draft's own cache: the same plugin (and options) the registry built for the target
    spec = KVSpec.of(model, ctx.engine, ctx.kv_spec.max_seq_len)
    kv_cache = type(ctx.kv_cache)(ctx.kv_cache.config, BuildContext(model, spec, ctx.engine))
    return ModelDrafter(config.drafter, model, kv_cache, sampler)


def kept_tokens(seq: Sequence, tokens: list[int]) -> list[int]:
    """What Sequence.append will keep: up to the length limit, and up to a stop token."""
    tokens = tokens[:seq.request.max_new_tokens - seq.num_output_tokens]
    for i, token in enumerate(tokens):
        if token in seq.request.stop_token_ids:
            return tokens[:i + 1]
    return tokens


def is_decoding(seq: Sequence, num_new_tokens: int) -> bool:
    """Past its prompt, and this step feeds it up to its last token: it can be drafted for."""
    return not seq.is_prefilling and seq.num_computed_tokens + num_new_tokens == seq.num_tokens


class Speculative(Decoding):
    name = "speculative"
    config_class = SpeculativeConfig
    exact = True
    stats_keys = ("drafter", "k", "proposed_tokens", "accepted_tokens", "acceptance_rate", "alpha",
                  "acceptance_by_position", "proposed_per_verification", "accepted_per_verification",
                  "tokens_per_target_forward", "verifications", "draft_time_per_step_ms",
                  "target_time_per_step_ms", "cost_ratio", "predicted_speedup", "draft_passes",
                  "draft_kv_reserved_bytes")

    def __init__(self, config: SpeculativeConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.k = config.k
        self.sampler = Sampler(config.seed)
        self.drafter = make_drafter(config, ctx, self.sampler)
        self.counters = SpeculativeStats(config.k)

    def num_drafts(self, seq: Sequence) -> int:
        """k, or fewer so that accepted drafts + one target token never pass max_new_tokens."""
        remaining = seq.request.max_new_tokens - seq.num_output_tokens
        return max(0, min(self.k, remaining - 1))

    def step(self, runner: ModelRunner, batch: Batch) -> dict[int, list[int]]:
        self.drafter.prepare(runner)
        drafting = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)) if is_decoding(seq, n)]
        seqs = [batch.seqs[i] for i in drafting]
        slot_of = {i: j for j, i in enumerate(drafting)}           # batch index -> index in `seqs`

        start = dev.now(runner.device)
        drafts, draft_probs = self.drafter.propose(seqs, [self.num_drafts(s) for s in seqs]) if seqs else ([], [])
        for j, i in enumerate(drafting):
            # room in the target's cache for the drafts too (a paged cache allocates blocks here)
            if drafts[j] and not runner.kv_cache.grow(seqs[j], batch.num_new_tokens[i] + len(drafts[j])):
                drafts[j], draft_probs[j] = [], None
        drafted = dev.now(runner.device)
        logits, rows = runner.forward(batch, {s.seq_id: d for s, d in zip(seqs, drafts) if d})   # (N, V)
        verified = dev.now(runner.device)
        if seqs:
            self.counters.record_step(drafted - start, verified - drafted)

        row_starts = [0]
        for r in rows:
            row_starts.append(row_starts[-1] + r)
        greedy = any(s.request.sampling.is_greedy for s in batch.seqs)
        argmax = logits.argmax(-1).tolist() if greedy else None            # one sync for the batch
        emitted: dict[int, list[int]] = {}
        for i, (seq, r) in enumerate(zip(batch.seqs, rows)):
            if r == 0:
                continue                            # a prompt chunk that does not reach its end yet
            block = slice(row_starts[i], row_starts[i] + r)
            if i not in slot_of:                    # prefill done: its first token, as autoregressive
                params = seq.request.sampling
                emitted[seq.seq_id] = ([argmax[block][0]] if params.is_greedy else
                                       [self.sampler.draw(probabilities(logits[block], params)[0], seq)])
                continue
            j = slot_of[i]
            emitted[seq.seq_id] = self._verify(runner, seq, drafts[j], draft_probs[j], logits[block],
                                               argmax[block] if argmax is not None else None)
        return emitted

    def _verify(self, runner: ModelRunner, seq: Sequence, drafts: list[int], q: torch.Tensor | None,
                logits: torch.Tensor, argmax: list[int] | None) -> list[int]:
        """Accept a prefix of the drafts, add the target's token, roll back what was rejected.

        logits (d+1, V): the target's at the pending token and each draft; q (d, V) or None: the
        drafts' distributions; argmax (d+1,): the target's greedy tokens when the batch has greedy requests.
        """
        if seq.request.sampling.is_greedy:
            verdict = accept_greedy(argmax, drafts)
        else:
            p = probabilities(logits, seq.request.sampling)                  # (d+1, V)
            verdict = accept_drafts(p, drafts, q, self.sampler.generator(seq))
        tokens = kept_tokens(seq, verdict.tokens)
        # computed: the history (its last token was pending) and the drafts that were kept; the
        # last emitted token is the new pending one
        num_computed = seq.num_tokens + len(tokens) - 1
        seq.num_computed_tokens = num_computed
        runner.kv_cache.truncate(seq, num_computed)
        self.drafter.rollback(seq, num_computed)
        self.counters.record_verification(seq.seq_id, len(drafts), verdict.num_accepted, len(tokens))
        return tokens

    def stats(self) -> dict[str, float | str]:
        return {"drafter": self.config.drafter, "k": self.k, **self.counters.as_dict(),
                "draft_passes": self.drafter.num_passes(),
                "draft_kv_reserved_bytes": self.drafter.bytes_reserved()}

    def close(self) -> None:
        self.drafter.close()
