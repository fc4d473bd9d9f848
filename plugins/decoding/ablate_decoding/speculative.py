"""decoding=speculative: draft k tokens cheaply, verify them all in one pass of the target.

One step, per sequence of the batch:
  prefilling   feed its prompt (chunk); once the prompt is in, emit its first token (as autoregressive)
  decoding     the drafter proposes up to k tokens x_1..x_k; ONE target pass over the pending token and
               the drafts (every sequence of the batch in the same pass) gives p_1..p_{k+1}; the
               acceptance rule (acceptance.py) keeps a prefix x_1..x_a and adds one target token, so a
               sequence emits 1..k+1 tokens and each sequence accepts its own number.
The engine then commits what each sequence accepted: the target's cache keeps the pending token and
the accepted drafts and forgets the rejected ones, as if they had never been written (a model
drafter's session forgets them at its next pass).
Greedy requests get exactly the target's greedy tokens; sampled ones the target's distribution.
"""
from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Any

import torch

from ablate.api import (Batch, BuildContext, Decoding, Executor, PluginConfig, Sampler, Sequence, Stat, StatFigure,
                        greedy as greedy_tokens, now, probabilities)
from ablate_decoding.acceptance import accept_drafts, accept_greedy
from ablate_decoding.draft_models import early_exit_layers, layer_skip_layers, layer_subset, load_draft_model
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
    # its own cache: the same plugin (and options) as the target's, through the arm's attention
    return ModelDrafter(config.drafter, ctx.model_session(model), sampler)


def kept_tokens(seq: Sequence, tokens: list[int]) -> list[int]:
    """What the engine will keep: up to the length limit, and up to a stop token."""
    tokens = tokens[:seq.request.max_new_tokens - seq.num_output_tokens]
    for i, token in enumerate(tokens):
        if token in seq.request.stop_token_ids:
            return tokens[:i + 1]
    return tokens


def _stat(key: str, description: str, unit: str = "", aggregate: str = "median") -> Stat:
    return Stat(key, description, unit, aggregate, table="Speculative decoding")


class Speculative(Decoding):
    name = "speculative"
    config_class = SpeculativeConfig
    exact = True
    reported_stats = (
        _stat("drafter", "who proposes the drafts", "text", "first"),
        _stat("k", "draft tokens proposed per sequence and step (at most)", "count"),
        _stat("alpha", "accepted / tested: the per-token acceptance of the speedup formula", "fraction"),
        _stat("acceptance_rate", "accepted / proposed", "fraction"),
        _stat("tokens_per_target_forward", "tokens emitted per target pass of a sequence", "x"),
        _stat("cost_ratio", "draft time per token / target time per step (c)", "ratio"),
        _stat("predicted_speedup", "over autoregressive decoding: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), "
              "from the measured alpha and c", "x"),
        Stat("proposed_tokens", "draft tokens proposed", "count"),
        Stat("accepted_tokens", "draft tokens accepted", "count"),
        Stat("acceptance_by_position", "acceptance at draft positions 1..k", "text", "first"),
        Stat("proposed_per_verification", "drafts per verification (mean)", "tokens"),
        Stat("accepted_per_verification", "accepted drafts per verification (mean)", "tokens"),
        Stat("verifications", "sequence verifications (one sequence in one target pass)", "count"),
        Stat("draft_time_per_step_ms", "drafting time per step", "ms"),
        Stat("target_time_per_step_ms", "target (verify) time per step", "ms"),
        Stat("draft_passes", "forward passes of the draft model", "count"),
        Stat("draft_kv_reserved_bytes", "bytes the draft model's own KV cache holds", "bytes"),
    )
    figures = (
        StatFigure("acceptance", "Acceptance vs draft length k", x="k", series=("alpha", "acceptance_rate"),
                   ylabel="acceptance", group_by="drafter",
                   caption="Speculative decoding by draft length k: per-token acceptance alpha (accepted / tested) "
                           "and accepted / proposed."),
        StatFigure("speculative_speedup", "Speedup vs draft length k", x="k", series=("speedup", "predicted_speedup"),
                   ylabel="speedup over the baseline (x)", group_by="drafter",
                   caption="Measured speedup (median, 95% CI) beside the one predicted from the measured alpha "
                           "and cost ratio c."),
    )

    def __init__(self, config: SpeculativeConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.k = config.k
        self.sampler = Sampler(config.seed)
        self.drafter = make_drafter(config, ctx, self.sampler)
        self.counters = SpeculativeStats(config.k)

    @property
    def num_lookahead_tokens(self) -> int:
        return self.k

    def step(self, executor: Executor, batch: Batch) -> dict[int, list[int]]:
        # draft for the sequences past their prompt whose step reaches their end, within the room reserved
        drafting = [i for i, (seq, emits) in enumerate(zip(batch.seqs, batch.emits))
                    if emits and not batch.seqs[i].is_prefilling]
        seqs = [batch.seqs[i] for i in drafting]
        room = [min(batch.num_lookahead_tokens[i], seq.max_num_tokens - 1 - seq.num_tokens)
                for i, seq in zip(drafting, seqs)]

        # host clocks around drafting: the last step ended waiting for its tokens, and a drafter's
        # tokens come back as host lists, so the device is idle at both points already (a
        # synchronisation there would cost a device round trip for nothing)
        start = time.perf_counter()
        drafts, draft_probs = self.drafter.propose(seqs, room) if seqs else ([], [])
        drafted = time.perf_counter()
        out = executor.forward(batch, {s.seq_id: d for s, d in zip(seqs, drafts) if d})   # one target pass
        greedy = any(s.request.sampling.is_greedy for s in batch.seqs)
        argmax = greedy_tokens(out.logits) if greedy else None             # one sync for the batch
        # the verify pass finished: the argmax waited for it, or the clock does
        verified = time.perf_counter() if greedy else now(executor.device)
        if seqs:
            self.counters.record_step(drafted - start, verified - drafted)

        slot_of = {i: j for j, i in enumerate(drafting)}           # batch index -> index in `seqs`
        starts = out.starts
        emitted: dict[int, list[int]] = {}
        for i, (seq, emits) in enumerate(zip(batch.seqs, batch.emits)):
            if not emits:
                continue                            # a prompt chunk that does not reach its end yet
            rows = slice(starts[i], starts[i + 1])
            if i not in slot_of:                    # prefill done: its first token, as autoregressive
                params = seq.request.sampling
                emitted[seq.seq_id] = ([argmax[rows][0]] if params.is_greedy else
                                       [self.sampler.draw(probabilities(out.logits[rows], params)[0], seq)])
                continue
            j = slot_of[i]
            emitted[seq.seq_id] = self._verify(seq, drafts[j], draft_probs[j], out.logits[rows],
                                               argmax[rows] if argmax is not None else None)
        return emitted

    def _verify(self, seq: Sequence, drafts: list[int], q: torch.Tensor | None,
                logits: torch.Tensor, argmax: list[int] | None) -> list[int]:
        """Accept a prefix of the drafts and add the target's token.

        logits (d+1, V): the target's at the pending token and each draft; q (d, V) or None: the
        drafts' distributions; argmax (d+1,): the target's greedy tokens when the batch has greedy requests.
        """
        if seq.request.sampling.is_greedy:
            verdict = accept_greedy(argmax, drafts)
        else:
            p = probabilities(logits, seq.request.sampling)                  # (d+1, V)
            verdict = accept_drafts(p, drafts, q, self.sampler.generator(seq))
        tokens = kept_tokens(seq, verdict.tokens)
        self.counters.record_verification(seq.seq_id, len(drafts), verdict.num_accepted, len(tokens))
        return tokens

    def stats(self) -> dict[str, float | str]:
        counters = self.counters.as_dict()
        return {"drafter": self.config.drafter, "k": self.k, **counters,
                "draft_passes": self.drafter.num_passes(),
                "draft_kv_reserved_bytes": self.drafter.bytes_reserved()}

    def close(self) -> None:
        self.drafter.close()
