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
bookkeeping of room and committed tokens lives in this base class, so a cache plugin implements
storage and room policy only. Everything is designed for ragged batches whose sequences join and
leave every step, steps that mix prompt chunks with decode tokens, and K/V that is rolled back
(speculative decoding rejects drafts).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ablate.api.executor import Executor
from ablate.api.kv import KVSpec, KVView
from ablate.api.plugin import Plugin, PluginConfig, PluginError, Slot
from ablate.api.sequence import Sequence, Status
from ablate.api.step import Batch, StepInputs

if TYPE_CHECKING:
    from ablate.api.context import BuildContext


class KVCache(Plugin):
    """Holds each running sequence's keys and values.

    Called by the core (final: a plugin does not override these):
      allocate(seq, n, lookahead) -> bool  scheduler helpers: room for the sequence's first
                                           computed + n + lookahead tokens; the first call admits it
      begin_step(step)                     runner: before a forward pass
      commit(seq, num_tokens)              engine: after a step, the first num_tokens are final
      release(seq)                         scheduler helpers: finished or preempted
      room(seq), num_committed(), room_holders()   what the core allocated and committed
    Implemented by the plugin (in that order of the lifecycle):
      reserve(seq, num_tokens) -> bool     room for the first num_tokens tokens; False, changing
                                           nothing, when there is none
      prepare(step) -> kv_lens | None      map this step's tokens to storage (once per forward pass)
      write(layer, step, k, v)             store this step's K/V of one layer
      view(layer, step) -> KVView          what attention reads for that layer
      keep(seq, num_tokens)                drop anything past the first num_tokens (rejected drafts)
      free(seq)                            give back everything the sequence holds
      bytes_reserved()                     bytes held for K/V now
    and may override num_cached_tokens (prefix caching), bytes_used, bytes_per_token and
    num_seqs_admitted when its storage differs from the defaults.
    """

    slot = Slot.KV_CACHE
    keeps_kv: ClassVar[bool] = True   # False: nothing is kept, the runner feeds each whole prefix every step

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.spec: KVSpec = ctx.kv_spec
        self._room: dict[int, int] = {}        # seq_id -> tokens allocated (written this step at most)
        self._committed: dict[int, int] = {}   # seq_id -> tokens whose K/V is final

    # -- called by the core ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Room for `seq`'s first num_computed + num_new + num_lookahead tokens; False: none, nothing changed.

        A sequence the cache does not hold yet is admitted; with prefix caching its first
        seq.num_computed_tokens tokens (set by the scheduler from num_cached_tokens) are the cached ones.
        """
        need = seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_new_tokens < 1 or num_lookahead_tokens < 0:
            raise PluginError("scheduler", "allocate", f"sequence {seq.seq_id}: num_new_tokens must be >= 1 and "
                              f"num_lookahead_tokens >= 0, got {num_new_tokens}, {num_lookahead_tokens}")
        if need > self.spec.max_seq_len:
            raise PluginError("scheduler", "allocate", f"sequence {seq.seq_id} would hold {need} tokens, more than "
                              f"the {self.spec.max_seq_len} the cache was built for (max_num_tokens - 1 at most)")
        held = self._room.get(seq.seq_id)
        if held is not None and need <= held:
            return True
        if not self.reserve(seq, need):
            return False
        self._room[seq.seq_id] = need
        self._committed.setdefault(seq.seq_id, seq.num_computed_tokens)
        return True

    def begin_step(self, step: StepInputs) -> StepInputs:
        """Runner, once per forward pass: prepare(), and the keys each sequence's view will hold."""
        kv_lens = self.prepare(step)
        if kv_lens is None:
            return step
        if len(kv_lens) != step.num_seqs:
            raise PluginError(self, "prepare", f"returned {len(kv_lens)} kv_lens for {step.num_seqs} sequences")
        step.kv_lens = list(kv_lens)
        step.kv_lens_t = torch.tensor(step.kv_lens, dtype=torch.int32, device=step.input_ids.device)
        return step

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Engine, after every step that fed `seq`: its first `num_tokens` tokens are final."""
        room = self._room.get(seq.seq_id)
        if room is None or not 0 <= num_tokens <= room:
            raise PluginError("engine", "commit", f"sequence {seq.seq_id}: {num_tokens} tokens committed to {self}, "
                              f"which holds room for {room or 0}")
        self.keep(seq, num_tokens)
        self._committed[seq.seq_id] = num_tokens
        self._room[seq.seq_id] = num_tokens

    def release(self, seq: Sequence) -> None:
        """Scheduler helpers: the sequence finished or was preempted; frees what it holds."""
        if self._room.pop(seq.seq_id, None) is None:
            return
        del self._committed[seq.seq_id]
        self.free(seq)

    def room(self, seq: Sequence) -> int:
        """Tokens allocated for `seq` (0: it holds nothing)."""
        return self._room.get(seq.seq_id, 0)

    def num_committed(self) -> dict[int, int]:
        """seq_id -> tokens committed, for every sequence the cache holds (a copy)."""
        return dict(self._committed)

    def room_holders(self) -> list[int]:
        """The sequences the core allocated room for and has not released."""
        return list(self._room)

    # -- implemented by the plugin -----------------------------------------------------------------
    @abstractmethod
    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure `seq` can hold its first `num_tokens` tokens; return False, changing nothing,
        when there is no room. The first call for a sequence admits it (contiguous: a row of the
        maximum length; paged: its blocks); later calls grow it. Called only through allocate()."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Give back everything `seq` holds; another sequence may take it at the next allocate."""

    def keep(self, seq: Sequence, num_tokens: int) -> None:
        """Only the first `num_tokens` tokens of `seq` are final: what was written past them (drafts
        the target rejected) is forgotten, and room past them may be given back. The next step
        writes from position num_tokens on. Called after every step that fed `seq`."""

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of a waiting `seq` whose K/V the cache holds already (prefix caching): the
        scheduler counts them as computed when it admits the sequence. Must leave its last token out."""
        return 0

    def prepare(self, step: StepInputs) -> list[int] | None:
        """Map this step's tokens to storage (sequence b writes positions context_lens[b] -
        query_lens[b] ... context_lens[b] - 1). Return how many keys each sequence's view holds when
        that is not context_lens (a cache that evicts); None otherwise."""
        return None

    @abstractmethod
    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's new keys and values of `layer`, k (T, H_kv, D_k) and v (T, H_kv, D_v),
        packed like the queries, at their sequences' positions."""

    @abstractmethod
    def view(self, layer: int, step: StepInputs) -> KVView:
        """What attention reads for `layer` after write(): every sequence's keys in batch order, this
        step's included, kv_lens[b] of them, in the model's dtype."""

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes held for K/V now, for the sequences or up front."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K/V takes in this cache's storage (override when storing compressed)."""
        return self.spec.bytes_per_token

    def bytes_used(self) -> int:
        """Live tokens x bytes per token: by default every committed token of every sequence held."""
        return sum(self._committed.values()) * self.bytes_per_token

    def num_seqs_admitted(self) -> int:
        """Sequences holding room now (admitted, not yet released): what a budget limits."""
        return len(self._room)


class Attention(Plugin):
    """softmax(q k^T / sqrt(D) + causal mask) v for every sequence of the step.

    Sequence b's queries are rows query_starts[b] : query_starts[b+1] of q; it has kv_lens[b] keys in
    the view, and its query i sees keys 0 .. kv_lens[b] - query_lens[b] + i (ablate.api.causal_mask).
    Query heads share K/V heads in groups: head h reads K/V head h // (H / H_kv).
    """

    slot = Slot.ATTENTION

    @property
    def backend(self) -> str:
        """The implementation that actually ran (recorded with the results)."""
        return self.name

    @abstractmethod
    def __call__(self, q: torch.Tensor, view: KVView, step: StepInputs) -> torch.Tensor:
        """q (T, H, D) packed queries -> (T, H, D_v) in q's dtype."""


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

    @abstractmethod
    def apply(self, model):
        """Return the model this arm runs: `model` itself, or a new model sharing its unchanged
        weights (arms share one loaded model, so never change it in place)."""
