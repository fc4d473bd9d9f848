"""Deliberately broken plugins: each is a correct built-in with one bug. The conformance kit must fail
every one of them, naming the plugin and the rule it breaks (test_kit_catches_broken_plugins.py)."""
from __future__ import annotations

from dataclasses import field, make_dataclass

import torch

from ablate.api import PaddedKV, Sequence, probabilities
from ablate.baselines.autoregressive import Autoregressive, AutoregressiveConfig
from ablate_decoding.acceptance import Verdict, accept_greedy
from ablate_decoding.speculative import Speculative, SpeculativeConfig, kept_tokens
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache
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
