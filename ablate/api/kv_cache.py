"""The KV-cache slot: the base class every cache plugin derives from, and its rules.

The base class keeps the core's bookkeeping (which sequences hold room, how many tokens each has
committed) and checks the calls; a plugin implements the storage and the room policy behind it.
Who calls what, in one engine step, is in ablate/api/slots.py.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ablate.api.kv import KVSpec, KVView, PagedPlaces
from ablate.api.plugin import Plugin, PluginConfig, PluginError, Slot, blame, final
from ablate.api.sequence import Sequence
from ablate.api.step import StepInputs, device_tensor

if TYPE_CHECKING:
    from ablate.api.context import BuildContext


class KVCache(Plugin):
    """Holds each running sequence's keys and values.

    Called by the core (final: a class that overrides one is refused when it is created):
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
    and may override num_cached_tokens (prefix caching), bytes_used, bytes_per_token (a property)
    and num_seqs_admitted when its storage differs from the defaults.

    A sequence is known by seq.seq_id, unique among the sequences one cache holds. An arm is built
    afresh for every run of an experiment, so a cache's counters start at zero each run.
    """

    slot = Slot.KV_CACHE
    keeps_kv: ClassVar[bool] = True   # False: nothing is kept, the runner feeds each whole prefix every step
    # True: a decode step can be captured into a CUDA graph (engine.graphs): prepare() puts every
    # per-step value write() and view() read into step.plan (tensors, or ints/slices that fix the
    # shapes), write() and view() read nothing else that changes between steps, and nothing waits
    # for the GPU. A graph is replayed for later steps with the same plan shapes (ablate/engine/graphs.py)
    graph_safe: ClassVar[bool] = False

    def __init__(self, config: PluginConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.spec: KVSpec = ctx.kv_spec
        self._room: dict[int, int] = {}        # seq_id -> tokens allocated (written this step at most)
        # seq_id -> the sequence: its tokens whose K/V is final are its num_computed_tokens (the engine
        # advances it, then commits that count), read there rather than copied here
        self._held: dict[int, Sequence] = {}

    # -- called by the core ------------------------------------------------------------------------
    @final
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
        with blame(self, "reserve"):
            if not self.reserve(seq, need):
                return False
        self._room[seq.seq_id] = need
        self._held.setdefault(seq.seq_id, seq)
        return True

    @final
    def begin_step(self, step: StepInputs) -> StepInputs:
        """Runner, once per forward pass: prepare(), and the keys each sequence's view will hold."""
        kv_lens = self.prepare(step)
        if kv_lens is None:
            return step
        if len(kv_lens) != step.num_seqs:
            raise PluginError(self, "prepare", f"returned {len(kv_lens)} kv_lens for {step.num_seqs} sequences")
        step.kv_lens = list(kv_lens)
        step.kv_lens_t = device_tensor(step.kv_lens, torch.int32, step.input_ids.device)
        return step

    @final
    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Engine, after every step that fed `seq` (advanced first): its first `num_tokens` tokens, its
        num_computed_tokens, are final."""
        room = self._room.get(seq.seq_id)
        if room is None or not 0 <= num_tokens <= room:
            raise PluginError("engine", "commit", f"sequence {seq.seq_id}: {num_tokens} tokens committed to {self}, "
                              f"which holds room for {room or 0}")
        if num_tokens != seq.num_computed_tokens:
            raise PluginError("engine", "commit", f"sequence {seq.seq_id}: {num_tokens} tokens committed to {self} "
                              f"but it has {seq.num_computed_tokens} computed: advance (or sync) it first")
        with blame(self, "keep"):
            self.keep(seq, num_tokens)
        self._room[seq.seq_id] = num_tokens

    @final
    def release(self, seq: Sequence) -> None:
        """Scheduler helpers: the sequence finished or was preempted; frees what it holds."""
        if self._room.pop(seq.seq_id, None) is None:
            return
        del self._held[seq.seq_id]
        with blame(self, "free"):
            self.free(seq)

    @final
    def room(self, seq: Sequence) -> int:
        """Tokens allocated for `seq` (0: it holds nothing)."""
        return self._room.get(seq.seq_id, 0)

    @final
    def num_committed(self) -> dict[int, int]:
        """seq_id -> tokens committed, for every sequence the cache holds (a copy)."""
        return {seq_id: seq.num_computed_tokens for seq_id, seq in self._held.items()}

    @final
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
        writes from position num_tokens on. Called after every step that fed `seq`; nothing to do
        for a cache whose views read only kv_lens keys and that keeps no room per token (the
        default does nothing)."""

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

    def paged_slots(self, step: StepInputs) -> PagedPlaces | None:
        """For a paged cache whose write() only copies this step's k and v to their rows: where every
        layer's rows go and view()'s PagedKV (PagedPlaces), so that a layer running the native paged
        decode kernel may write and read the cache itself, in one native call (ablate/model/native_plan.py;
        the conformance kit checks them against write() and view()). None (the default): every layer
        calls write() and view()."""
        return None

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes held for K/V between steps, for the sequences or up front (within the budget). A
        temporary made in view() (a dequantised copy) is activation memory, not counted here: the
        run's peak memory counts it."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K/V takes in this cache's storage, anything stored per token included
        (quantisation scales). Override when storing another form than the model's dtype: the
        results, the analytic model and the memory figures use it."""
        return self.spec.bytes_per_token

    def bytes_used(self) -> int:
        """Live tokens x bytes per token: by default every committed token of every sequence held."""
        return sum(seq.num_computed_tokens for seq in self._held.values()) * self.bytes_per_token

    def num_seqs_admitted(self) -> int:
        """Sequences holding room now (admitted, not yet released): what a budget limits."""
        return len(self._room)

