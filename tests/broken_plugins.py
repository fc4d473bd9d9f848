"""Deliberately broken plugins: each is a correct built-in with one bug. The conformance kit must fail
every one of them, naming the plugin and the rule it breaks (test_kit_catches_broken_plugins.py)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field, make_dataclass

import torch

from ablate.api import (PaddedKV, QualityBound, SamplingParams, Sequence, causal_mask, pad_queries, probabilities,
                        unpad_queries)
from ablate.baselines.autoregressive import Autoregressive, AutoregressiveConfig
from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate_decoding.acceptance import Verdict, accept_greedy
from ablate_decoding.speculative import Speculative, SpeculativeConfig, kept_tokens
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache
from ablate_kv_cache.paged import PagedConfig, PagedKVCache
from ablate_scheduler.continuous import ContinuousConfig, ContinuousScheduler
from ablate_streaming.cache import StreamingConfig, StreamingKVCache


def config(base: type, name: str) -> type:
    """A config dataclass like `base` whose `name` defaults to `name`."""
    return make_dataclass(f"{name.title().replace('_', '')}Config", [("name", str, field(default=name))], bases=(base,))


# -- KV caches -----------------------------------------------------------------------------------------

class LateWrite(ContiguousKVCache):
    """Writes every token one position after its own."""
    name = "late_write"
    config_class = config(ContiguousConfig, name)

    def prepare(self, step):
        super().prepare(step)
        self.plan_rows([self.slot_of[s.seq_id] for s in step.seqs], step, [-1] * step.num_seqs)


class ShortView(ContiguousKVCache):
    """Hands attention one key fewer than the sequence has."""
    name = "short_view"
    config_class = config(ContiguousConfig, name)

    def view(self, layer, step):
        full = super().view(layer, step)
        s = step.max_kv_len - 1
        return PaddedKV(full.k[:, :s], full.v[:, :s])


class ForgetsDecodeTokens(ContiguousKVCache):
    """Stores prompts but not the tokens of decode steps."""
    name = "forgets_decode"
    config_class = config(ContiguousConfig, name)

    def write(self, layer, step, k, v):
        if not step.is_decode:
            super().write(layer, step, k, v)


class FirstLayerOnly(ContiguousKVCache):
    """Stores layer 0's K/V only."""
    name = "first_layer_only"
    config_class = config(ContiguousConfig, name)

    def write(self, layer, step, k, v):
        if layer == 0:
            super().write(layer, step, k, v)


def swapped(view: PaddedKV) -> PaddedKV:
    """Sequence b reads sequence B-1-b's row (identity for a batch of one)."""
    return PaddedKV(view.k.flip(0), view.v.flip(0))


class SwapsRowsExact(ContiguousKVCache):
    """Gives each sequence of a batch another sequence's K/V."""
    name = "swaps_rows"
    config_class = config(ContiguousConfig, name)

    def view(self, layer, step):
        return swapped(super().view(layer, step))


class SwapsRowsLossy(StreamingKVCache):
    """The same mix-up in a cache that is not exact (a sliding window): only batch invariance tells."""
    name = "swaps_rows_lossy"
    config_class = config(StreamingConfig, name)

    def view(self, layer, step):
        return swapped(super().view(layer, step))


class NeverFrees(ContiguousKVCache):
    """Keeps a released sequence's row."""
    name = "never_frees"
    config_class = config(ContiguousConfig, name)

    def free(self, seq):
        pass


class ReservedLies(ContiguousKVCache):
    """Reports no memory held."""
    name = "reserved_lies"
    config_class = config(ContiguousConfig, name)

    def bytes_reserved(self):
        return 0


class UsedLies(ContiguousKVCache):
    """Reports half the bytes its tokens take."""
    name = "used_lies"
    config_class = config(ContiguousConfig, name)

    def bytes_used(self):
        return super().bytes_used() // 2


# -- schedulers ----------------------------------------------------------------------------------------

class NeverReleases(ContinuousScheduler):
    """Retires finished sequences without giving their room back."""
    name = "never_releases"
    config_class = config(ContinuousConfig, name)

    def finish_step(self, batch):
        for seq in batch.seqs:
            if seq.is_finished and seq in self.running:
                self.running.remove(seq)


class IgnoresMaxNumSeqs(ContinuousScheduler):
    """Admits every waiting sequence, whatever engine.max_num_seqs says."""
    name = "ignores_max_num_seqs"
    config_class = config(ContinuousConfig, name)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.max_num_seqs = 10**6


class DropsArrivals(ContinuousScheduler):
    """Loses every third request it is given."""
    name = "drops_arrivals"
    config_class = config(ContinuousConfig, name)

    def add(self, seq):
        if seq.seq_id % 3 != 2:
            super().add(seq)


class Starves(ContinuousScheduler):
    """Keeps request 0 waiting for ever."""
    name = "starves"
    config_class = config(ContinuousConfig, name)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.starved: list[Sequence] = []

    def add(self, seq):
        (self.starved if seq.seq_id == 0 else self.waiting).append(seq)

    def has_unfinished(self):
        return bool(self.starved) or super().has_unfinished()


# -- decoding ------------------------------------------------------------------------------------------

class WrongGreedyToken(Autoregressive):
    """Emits the target's second choice for request 1."""
    name = "wrong_greedy"
    config_class = config(AutoregressiveConfig, name)

    def step(self, executor, batch):
        out = executor.forward(batch)
        emitting = [seq for seq, emits in zip(batch.seqs, batch.emits) if emits]
        best2 = out.logits.topk(2, dim=-1).indices.tolist()          # (N, 2)
        return {seq.seq_id: [pair[1] if seq.seq_id == 1 else pair[0]] for seq, pair in zip(emitting, best2)}


def biased_accept(p: torch.Tensor, drafts: list[int], generator: torch.Generator) -> Verdict:
    """Speculative sampling with a one-hot draft whose rejection samples from p itself instead of p
    with the draft removed: the draft token gets more than its probability."""
    accepted = 0
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=generator)) < float(p[i, x]):
            accepted += 1
            continue
        token = int(torch.multinomial(p[i], 1, generator=generator))     # should exclude x
        return Verdict(accepted, drafts[:accepted] + [token])
    return Verdict(accepted, drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))])


class BiasedSpeculative(Speculative):
    """The n-gram speculative decoder with a biased rejection rule for sampled requests."""
    name = "biased_speculative"
    config_class = config(SpeculativeConfig, name)

    def _verify(self, seq, drafts, q, logits, argmax):
        if seq.request.sampling.is_greedy:
            verdict = accept_greedy(argmax, drafts)
        else:
            p = probabilities(logits, seq.request.sampling).cpu()
            verdict = biased_accept(p, drafts, self.sampler.generator(seq))
        tokens = kept_tokens(seq, verdict.tokens)
        self.counters.record_verification(seq.seq_id, len(drafts), verdict.num_accepted, len(tokens))
        return tokens


# -- found only when a scenario reaches its state (ablate/testing/coverage.py) -------------------------

class NeverResumes(ContinuousScheduler):
    """Preempts the newest sequence to make room, then forgets it: it never runs again."""
    name = "never_resumes"
    config_class = config(ContinuousConfig, name)

    def _grow_or_preempt(self, seq, num_tokens):
        while not self.grow(seq, num_tokens):
            victim = self.running.pop()
            self.preempt(victim)              # should go back to the front of self.waiting
            if victim is seq:
                return False
        return True


class AdmitsTwice(ContinuousScheduler):
    """Queues a preempted sequence twice, so it is admitted again while it already runs."""
    name = "admits_twice"
    config_class = config(ContinuousConfig, name)

    def preempt(self, seq):
        super().preempt(seq)
        self.waiting.appendleft(seq)          # the caller queues it too


class ClaimsPreemptedCached(ContinuousScheduler):
    """Resumes a preempted sequence as if the cache still held what it had computed (swap, not
    recompute): the cache refuses the claim with a bare ValueError, which is the scheduler's fault."""
    name = "claims_preempted_cached"
    config_class = config(ContinuousConfig, name)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.computed_before: dict[int, int] = {}

    def preempt(self, seq):
        self.computed_before[seq.seq_id] = seq.num_computed_tokens
        super().preempt(seq)

    def admit(self, seq, num_new_tokens, num_cached_tokens=0):
        cached = num_cached_tokens or self.computed_before.pop(seq.seq_id, 0)
        return super().admit(seq, max(1, num_new_tokens - cached), cached)


class OneAtATime(ContinuousScheduler):
    """Serves one sequence at a time: right tokens, but the cache never runs out of room, so the kit
    never sees it preempt."""
    name = "one_at_a_time"
    config_class = config(ContinuousConfig, name)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.max_num_seqs = 1


class SamplesOtherwise(Autoregressive):
    """Greedy requests right, sampled ones drawn with `sampled_as(their params)` instead of them."""

    def sampled_as(self, params: SamplingParams) -> SamplingParams:
        raise NotImplementedError

    def step(self, executor, batch):
        out = executor.forward(batch)
        emitting = [seq for seq, emits in zip(batch.seqs, batch.emits) if emits]
        tokens = {}
        for row, seq in zip(out.logits, emitting):
            params = seq.request.sampling
            if params.is_greedy:
                tokens[seq.seq_id] = [int(row.argmax())]
            else:
                tokens[seq.seq_id] = [self.sampler.draw(probabilities(row[None], self.sampled_as(params))[0], seq)]
        return tokens


class IgnoresTemperature(SamplesOtherwise):
    """Samples every sampled request at temperature 1."""
    name = "ignores_temperature"
    config_class = config(AutoregressiveConfig, name)

    def sampled_as(self, params):
        return SamplingParams(1.0, params.top_p, params.seed)


class IgnoresTopP(SamplesOtherwise):
    """Samples from the whole distribution whatever top_p says."""
    name = "ignores_top_p"
    config_class = config(AutoregressiveConfig, name)

    def sampled_as(self, params):
        return SamplingParams(params.temperature, 1.0, params.seed)


class LogitsByBatchIndex(Autoregressive):
    """Reads an emitting sequence's logits at its index in the batch (right while every sequence of a
    step emits; a prompt chunk that emits nothing has no row)."""
    name = "logits_by_batch_index"
    config_class = config(AutoregressiveConfig, name)

    def step(self, executor, batch):
        out = executor.forward(batch)
        index = [i for i, emits in enumerate(batch.emits) if emits]
        emitting = [batch.seqs[i] for i in index]
        tokens = self.sampler.sample(out.logits[index], emitting)
        return {seq.seq_id: [tok] for seq, tok in zip(emitting, tokens)}


class ScalesKInPlace(NaiveAttention):
    """Folds 1/sqrt(D) into the keys in place (k.mul_) to save a multiply on the scores: right over a
    cache whose view is a copy, but a view of the storage scales the cached keys again every step."""
    name = "scales_k_in_place"
    config_class = config(NaiveAttentionConfig, name)

    def __call__(self, q, view, step):
        k, v = view.padded(step)                                   # (B, S, H_kv, D)
        k.mul_(1.0 / math.sqrt(q.shape[-1]))
        qp = pad_queries(q, step)                                  # (B, Lq, H, D)
        b, lq, h, d = qp.shape
        h_kv, dv = k.shape[2], v.shape[-1]
        g = h // h_kv
        qg = qp.view(b, lq, h_kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, g * lq, d)
        scores = (qg.float() @ k.permute(0, 2, 3, 1).float()).view(b, h_kv, g, lq, -1)
        scores = scores.masked_fill(~causal_mask(step)[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, h_kv, g * lq, -1)
        out = probs @ v.permute(0, 2, 1, 3).float()                # (B, H_kv, G*Lq, D_v)
        out = out.view(b, h_kv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(b, lq, h, dv)
        return unpad_queries(out.to(q.dtype), step)


class ZeroBytesPerToken(ContiguousKVCache):
    """Reports that a token takes no bytes."""
    name = "zero_bytes_per_token"
    config_class = config(ContiguousConfig, name)

    @property
    def bytes_per_token(self):
        return 0


class HalfBytesPerToken(ContiguousKVCache):
    """Reports half the bytes a token takes in its storage (as if it compressed 2x)."""
    name = "half_bytes_per_token"
    config_class = config(ContiguousConfig, name)

    @property
    def bytes_per_token(self):
        return self.spec.bytes_per_token // 2


class CompressedIgnoresBudget(ContiguousKVCache):
    """Stores K/V in fp16 (half the tiny model's fp32 bytes) and sizes its pool for engine.max_num_seqs,
    dropping kv_cache.budget_bytes: a budget set in the model's bytes per token never shows it."""
    name = "compressed_ignores_budget"
    config_class = config(ContiguousConfig, name)
    exact = False
    quality = QualityBound(max_ratio=1.01, num_tokens=64)

    def __init__(self, config, ctx):
        super().__init__(dataclasses.replace(config, budget_bytes=0), ctx)    # the bug
        self.config = config
        self.k, self.v = self.k.half(), self.v.half()

    @property
    def bytes_per_token(self):
        return self.spec.bytes_per_token * self.k.element_size() // self.spec.dtype.itemsize

    def write(self, layer, step, k, v):
        super().write(layer, step, k.to(self.k.dtype), v.to(self.v.dtype))

    def view(self, layer, step):
        stored = super().view(layer, step)
        return PaddedKV(stored.k.to(self.spec.dtype), stored.v.to(self.spec.dtype))


class SlotsOffByOne(PagedKVCache):
    """Gives a native layer the rows one past those write() fills (KVCache.paged_slots)."""
    name = "slots_off_by_one"
    config_class = config(PagedConfig, name)

    def paged_slots(self, step):
        places = super().paged_slots(step)
        return None if places is None else dataclasses.replace(places, slot_mapping=places.slot_mapping + 1)
