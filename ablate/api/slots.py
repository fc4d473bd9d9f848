"""The engine interface: one base class per slot, and the rules of each.

One engine step, and who calls what:

    scheduler.next_batch()                 the scheduler's policy; it admits and grows sequences through
      -> Scheduler.admit / grow / preempt  its base-class helpers, which call kv_cache.allocate / release
    decoding.step(executor, batch)         runs the model (executor.forward) and picks tokens
      -> kv_cache.begin_step(step)         the runner, once per forward pass: prepare()
      -> kv_cache.write / view             every layer: store this step's K/V, then read the layer's view
      -> attention(q, view, step)          every layer
    engine: seq.advance(...)               the engine commits what decoding emitted, then
      -> kv_cache.commit(seq, n)           tells the cache how many tokens are final: keep()
    scheduler.finish_step(batch)           releases the room of finished sequences (policy: when)

A Sequence is only ever changed by the core (ablate.api.sequence); plugins read it. A cache's
bookkeeping of room and committed tokens lives in its base class (ablate/api/kv_cache.py), so a
cache plugin implements storage and room policy only. Everything is designed for ragged batches
whose sequences join and leave every step, steps that mix prompt chunks with decode tokens, and
K/V that is rolled back (speculative decoding rejects drafts). A rule broken is a PluginError
naming `<slot>=<name>.<method>`, raised by the engine as it runs.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence as ListOf
from typing import TYPE_CHECKING, ClassVar

import torch

from ablate.api.executor import Executor
from ablate.api.kv import KVView
from ablate.api.packing import LayerAttention
from ablate.api.kv_cache import KVCache
from ablate.api.plugin import Plugin, PluginConfig, PluginError, Slot
from ablate.api.sequence import Sequence, Status
from ablate.api.step import Batch, StepInputs

if TYPE_CHECKING:
    from ablate.api.context import BuildContext


class Attention(Plugin):
    """softmax(q k^T / sqrt(D) + causal mask) v for every sequence of the step.

    Sequence b's queries are rows query_starts[b] : query_starts[b+1] of q; it has kv_lens[b] keys in
    the view, and its query i sees keys 0 .. kv_lens[b] - query_lens[b] + i (ablate.api.causal_mask).
    Query heads share K/V heads in groups: head h reads K/V head h // (H / H_kv).

    A layer that needs more (a sliding window, soft-capped scores: Mistral, Qwen2, Gemma) is called
    as attention(q, view, step, layer) with its LayerAttention, and only when the plugin declares
    those features in `features`; a model with such layers is refused at build time by a plugin that
    does not (missing_features), so a plugin declaring none is only ever called with three arguments.
    """

    slot = Slot.ATTENTION
    # True: a decode step can be captured into a CUDA graph (engine.graphs): the plugin reads
    # per-sequence lengths from step.kv_lens_t (not the lists) when step.graphed, allocates only
    # through torch, and never waits for the GPU (.item(), .tolist(), nonzero(), bool(tensor))
    graph_safe: ClassVar[bool] = False
    # the LayerAttention features __call__ computes when passed a layer: "sliding_window", "softcap"
    features: ClassVar[frozenset[str]] = frozenset()
    # True: masks a PaddedKV whose rows are a ring (view.ring > 0: a windowed layer's cache keeping
    # only its window) by its rows' positions, causal_mask(step, num_keys, window, view.ring). A cache
    # keeps every position for a plugin that does not say so, whose mask would read rows as positions
    reads_key_rings: ClassVar[bool] = False

    @classmethod
    def missing_features(cls, layers: ListOf[LayerAttention | None]) -> str | None:
        """Why this plugin cannot run a model whose layers need `layers` (one per layer, None: plain
        attention), naming the plugin, each feature it lacks and the layers that need it; or None."""
        lacking: dict[str, list[int]] = {}
        for index, layer in enumerate(layers):
            for feature in sorted(layer.features - cls.features if layer is not None else ()):
                lacking.setdefault(feature, []).append(index)
        if not lacking:
            return None
        needs = "; ".join(f"{feature} (layers {', '.join(map(str, where))})" for feature, where in lacking.items())
        return (f"attention={cls.name} does not support {needs}, which the model needs; choose an attention "
                f"plugin that declares {' and '.join(lacking)} in its `features` (naive, sdpa, paged)")

    @property
    def backend(self) -> str:
        """The implementation that actually ran (recorded with the results)."""
        return self.name

    @abstractmethod
    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        """q (T, H, D) packed queries -> (T, H, D_v) in q's dtype. A plugin declaring `features` takes a
        fourth argument, `layer: LayerAttention | None = None`."""

    def native_paged_decode(self, step: StepInputs) -> bool:
        """True where this decode step's plain layers, over a PagedKV, run exactly ablate.api.native's
        paged_decode_attention (the scale 1 / sqrt(D), torch's threads), as chosen by a layer of the
        step that has already called the plugin: a layer may then run that kernel itself, inside a
        native call (ablate/model/native_plan.py). False (the default): every layer calls the plugin."""
        return False


class Scheduler(Plugin):
    """Which sequences run each step, and how many new tokens each feeds (the policy).

    A plugin implements add, next_batch, finish_step and has_unfinished, and changes sequences and
    the cache only through the helpers below (admit, grow, preempt, release): they keep the
    sequence's status, the room it holds and the draft lookahead consistent. Every sequence in a
    batch must be RUNNING with room for its new tokens (the engine checks); at most
    engine.max_num_seqs sequences hold room at once and a batch feeds at most
    engine.max_num_batched_tokens tokens.
    """

    slot = Slot.SCHEDULER
    # True: when the cache cannot grow a running sequence, the scheduler preempts one (and resumes it
    # later). The conformance kit then runs it out of cache room while sequences grow and requires
    # preemptions and resumptions; a scheduler that cannot preempt is run out of room at admission only
    preempts: ClassVar[bool] = False

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.kv_cache: KVCache = ctx.kv_cache
        self.max_num_seqs = ctx.engine.max_num_seqs
        self.max_num_batched_tokens = ctx.engine.max_num_batched_tokens
        self.num_lookahead_tokens = ctx.num_lookahead_tokens   # drafts the decoding may feed per sequence

    # -- the policy --------------------------------------------------------------------------------
    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """A request arrived (WAITING, nothing computed)."""

    @abstractmethod
    def next_batch(self) -> Batch | None:
        """This step's work; None when nothing can run now."""

    @abstractmethod
    def finish_step(self, batch: Batch) -> None:
        """After the engine committed the step: release the room of finished sequences (`release`),
        now or when the policy says (a static batch holds it until its last member finishes)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Any sequence waiting or holding room."""

    # -- helpers: the only way a scheduler changes a sequence or the cache -------------------------
    def admit(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Start a WAITING sequence: room for its first num_cached_tokens + num_new_tokens (plus the
        lookahead when that reaches its end). num_cached_tokens: what kv_cache.num_cached_tokens(seq)
        said (0: recompute everything). False: no room; nothing changed."""
        if seq.status is not Status.WAITING:
            raise PluginError(self, "admit", f"sequence {seq.seq_id} is {seq.status.value}, not waiting")
        seq.start(num_cached_tokens)
        if self._allocate(seq, num_new_tokens):
            return True
        seq.requeue()
        return False

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for a RUNNING sequence's next num_new_tokens (plus the lookahead when that reaches
        its end). False: no room (preempt someone, or wait)."""
        if seq.status is not Status.RUNNING:
            raise PluginError(self, "grow", f"sequence {seq.seq_id} is {seq.status.value}, not running")
        return self._allocate(seq, num_new_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Take a RUNNING sequence's room back: it waits again with nothing computed (recompute)."""
        if seq.status is not Status.RUNNING:
            raise PluginError(self, "preempt", f"sequence {seq.seq_id} is {seq.status.value}, not running")
        self.kv_cache.release(seq)
        seq.preempt()

    def release(self, seq: Sequence) -> None:
        """A finished sequence gives its room back."""
        self.kv_cache.release(seq)

    def lookahead(self, seq: Sequence, num_new_tokens: int) -> int:
        """Draft room to reserve beyond the new tokens: decoding's lookahead when this step reaches
        the sequence's end, never past max_num_tokens - 1 tokens (what its cache can ever hold)."""
        if not self.num_lookahead_tokens or seq.num_computed_tokens + num_new_tokens != seq.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, seq.max_num_tokens - 1 - seq.num_tokens))

    def _allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        lookahead = self.lookahead(seq, num_new_tokens)
        if lookahead and self.kv_cache.allocate(seq, num_new_tokens, lookahead):
            return True
        return self.kv_cache.allocate(seq, num_new_tokens)    # no room for drafts: decode without them


class Decoding(Plugin):
    """How tokens are picked once the model has run: one per step, or several (speculative)."""

    slot = Slot.DECODING

    @property
    def num_lookahead_tokens(self) -> int:
        """The most draft tokens step() feeds per sequence beyond its new ones: the scheduler
        reserves cache room for them."""
        return 0

    @abstractmethod
    def step(self, executor: Executor, batch: Batch) -> dict[int, list[int]]:
        """Run the batch (executor.forward, once) and return the tokens each sequence emits: seq_id
        -> tokens, for exactly the sequences with batch.emits[i]. All tokens but the last must be
        draft tokens this step fed and accepted, in order (their K/V is in the cache); the last is
        the model's own. Change nothing else: the engine commits the step."""


class ModelVariant(Plugin):
    """Changes the loaded model (fewer KV heads, latent KV) before the engine runs it."""

    slot = Slot.MODEL

    @classmethod
    def refusal(cls, config, model) -> str | None:
        """Why this variant, with its `config`, cannot convert a model of this shape (a ModelConfig:
        the preset's, or the checkpoint's config read without its weights), or None. Asked when the
        job is planned, before any model loads; apply() may still refuse what only weights show."""
        return None

    @abstractmethod
    def apply(self, model):
        """Return the model this arm runs: `model` itself, or a new model sharing its unchanged
        weights (arms share one loaded model, so never change it in place)."""
