"""kv_cache=streaming: a sliding window with attention sinks (StreamingLLM: Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks").

Each sequence keeps the K/V of its first `num_sinks` tokens and of its `window` most recent ones;
the tokens in between are evicted. Softmax attention has to put its mass somewhere, and trained
models put much of it on the first tokens whatever they say (the "attention sinks"): a plain
sliding window that evicts them falls apart, one that keeps a few does not. A sequence thus holds
at most num_sinks + window tokens between steps however long it grows. Not exact: a token past
num_sinks + window no longer sees the evicted ones. A sequence that never grows past
num_sinks + window gives exactly the baseline's tokens.

Positions. The paper assigns RoPE positions within the cache (the i-th key held is rotated by i),
so the distances a query sees never exceed the cache's size. Here keys stay rotated at their
original positions, as the engine writes them (keys are cached after RoPE), and eviction only drops
rows: nothing is re-rotated, and the cache is exact up to its first eviction. The price: positions
keep growing, so a sequence cannot outgrow the model's max_seq_len (its RoPE table), and far into a
long stream a query sees its sinks at distances the model may never have been trained on (the
paper's re-positioning avoids both).

Layout. A sequence owns one row of a (layers, slots, capacity, H_kv, D) buffer:

    [ sinks | recent tokens, oldest first | this step's new tokens ]

so what attention reads is the row's first held + new entries, fewer than the sequence's length
once it has evicted. `prepare` therefore returns what each row holds as the step's kv_lens (every
attention plugin reads them as the number of keys in the view: naive's and sdpa's masks, flash's
kernels), while the positions stay absolute (RoPE). A step's queries see the held tokens and, causally,
the step's own, as in the paper's prefill.

Eviction happens at the start of a sequence's next step, not at the end of this one, so that a
speculative verification can roll back its rejected drafts (`keep`) while they are still the
newest tokens; rolling back further only drops held tokens (evicted ones do not come back, the
window refills as the sequence grows). Between steps a row thus holds up to num_sinks + window +
the last step's new tokens. Evicting moves the kept window down to just after the sinks: one copy
of `window` tokens per sequence and step, as the reference implementation's torch.cat per step (a
ring buffer would save the copy, at the price of rollbacks across its wrap). Rows are as long as the
longest step needs, sinks + window + its new tokens: chunked prefill
(scheduler=continuous scheduler.chunked_prefill=true) keeps a long prompt from widening them.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ablate.api import (BuildContext, KVBudgetConfig, KVCache, QualityBound, RowBuffers, Sequence, Stat, StepInputs,
                        budget_bytes)


@dataclass
class StreamingConfig(KVBudgetConfig):
    """The budget (bytes or a fraction of free memory) caps the slots x capacity buffer."""

    name: str = "streaming"
    num_sinks: int = 4        # first tokens kept for good: the attention sinks (the paper keeps 4)
    window: int = 256         # most recent tokens kept besides the sinks

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sinks < 0:
            raise ValueError(f"kv_cache.num_sinks must be >= 0, got {self.num_sinks}")
        if self.window < 1:
            raise ValueError(f"kv_cache.window must be >= 1, got {self.window}")


@dataclass
class Row:
    """What one sequence's row holds: positions 0 .. s-1 at row indices 0 .. s-1, s = min(num_sinks,
    first_recent), then positions first_recent .. length-1 in order. Until the first eviction
    first_recent is 0: the row holds positions 0 .. length-1 at their own indices."""

    slot: int
    first_recent: int = 0     # position of the oldest non-sink token held
    length: int = 0           # positions accounted for: the sequence's next token has position `length`


class StreamingKVCache(RowBuffers, KVCache):
    name = "streaming"
    config_class = StreamingConfig
    exact = False                      # evicted tokens are no longer attended to
    # the kit's check: a window of 16 on a 96-token text evicts from the 22nd token on; ratio 1.88 measured
    # (1.25 before random embeddings became a small share of the residual stream: attention, and so
    # what the window evicts, then carries more of the output), the bound 1.2x that as before
    quality = QualityBound(max_ratio=2.25, num_tokens=96, config={"num_sinks": 4, "window": 16})
    reported_stats = (
        Stat("kv_capacity_tokens", "tokens per row", "tokens"),
        Stat("kv_peak_reserved_bytes", "largest buffer held", "bytes"),
        Stat("tokens_evicted", "tokens dropped from rows", "count", table="KV cache"),
        Stat("peak_tokens_held", "most tokens one row held during a step", "tokens", table="KV cache"),
        Stat("max_seqs_admitted", "most sequences holding a row at once", "count"),
    )

    def __init__(self, config: StreamingConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.num_sinks, self.window = config.num_sinks, config.window
        self.budget_bytes = budget_bytes(config, self.spec.device, self.spec.bytes_per_token)    # 0: no limit beyond the slots
        # a row long enough for one decode step once full (or for the longest sequence, if shorter)
        capacity = min(self.num_sinks + self.window + 1, max(self.spec.max_seq_len, 1))
        self.num_slots = self.spec.max_num_seqs
        if self.budget_bytes:
            self.num_slots = min(self.num_slots, self.budget_bytes // (capacity * self.spec.bytes_per_token))
            if self.num_slots == 0:
                raise ValueError(f"kv_cache=streaming: the KV budget of {self.budget_bytes} bytes holds no row of {capacity} tokens "
                                 f"({capacity * self.spec.bytes_per_token} bytes)")
        self.rows: dict[int, Row] = {}                    # seq_id -> its row
        self.free_slots = list(range(self.num_slots))     # a heap: the lowest free slot first keeps rows together
        self.k = self.v = torch.empty(0, device=self.spec.device)   # replaced by _allocate below
        self.peak_reserved = 0
        self.tokens_evicted = 0       # tokens dropped from rows, over the cache's life
        self.peak_tokens_held = 0     # most tokens one row held during a step (held + new)
        self.max_seqs_admitted = 0
        self._allocate(capacity)

    # -- storage -----------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate to (layers, slots, capacity, H_kv, D), keeping what is stored."""
        s = self.spec
        shape = (s.num_layers, self.num_slots, capacity, s.n_kv_heads)
        new_k = torch.zeros(*shape, s.k_head_dim, dtype=s.dtype, device=s.device)
        new_v = torch.zeros(*shape, s.v_head_dim, dtype=s.dtype, device=s.device)
        if self.k.dim() == 5:
            kept = min(self.capacity, capacity)
            new_k[:, :, :kept] = self.k[:, :, :kept]
            new_v[:, :, :kept] = self.v[:, :, :kept]
        self.k, self.v = new_k, new_v
        self.peak_reserved = max(self.peak_reserved, self.bytes_reserved())

    def bytes_reserved(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def _room_for(self, num_tokens: int) -> bool:
        """Rows of at least `num_tokens`, within the budget; False: the budget forbids it."""
        if num_tokens <= self.capacity:
            return True
        if self.budget_bytes and self.num_slots * num_tokens * self.spec.bytes_per_token > self.budget_bytes:
            return False
        self._allocate(num_tokens)
        return True

    # -- which tokens a row holds ------------------------------------------------------------------
    def _num_held(self, row: Row) -> int:
        return min(self.num_sinks, row.first_recent) + row.length - row.first_recent

    def _evict(self, row: Row) -> None:
        """Keep the sinks and the `window` newest tokens, moved down to just after the sinks."""
        excess = self._num_held(row) - (self.num_sinks + self.window)
        if excess <= 0:
            return
        first_kept = row.length - self.window
        src = min(self.num_sinks, row.first_recent) + first_kept - row.first_recent   # row index of first_kept
        dst = self.num_sinks
        for buf in (self.k, self.v):                      # (layers, slots, capacity, H_kv, D)
            # the ranges overlap when fewer than `window` tokens go: copy out first
            buf[:, row.slot, dst:dst + self.window] = buf[:, row.slot, src:src + self.window].clone()
        row.first_recent = first_kept
        self.tokens_evicted += excess

    # -- room ---------------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        row = self.rows.get(seq.seq_id)
        if row is None and not self.free_slots:
            return False
        # the next step first evicts down to num_sinks + window, then adds what is new
        held = min(self._num_held(row), self.num_sinks + self.window) if row else 0
        if not self._room_for(held + num_tokens - (row.length if row else 0)):
            return False
        if row is None:
            self.rows[seq.seq_id] = Row(heapq.heappop(self.free_slots))
            self.max_seqs_admitted = max(self.max_seqs_admitted, len(self.rows))
        return True

    def keep(self, seq: Sequence, num_tokens: int) -> None:
        """Drop every held token at position >= num_tokens (evicted ones stay evicted)."""
        row = self.rows[seq.seq_id]
        if num_tokens < row.first_recent:       # every recent token goes, and the sinks past num_tokens
            row.first_recent = num_tokens
        row.length = min(row.length, num_tokens)

    def free(self, seq: Sequence) -> None:
        heapq.heappush(self.free_slots, self.rows.pop(seq.seq_id).slot)

    def num_seqs_admitted(self) -> int:
        return len(self.rows)

    def bytes_used(self) -> int:
        """The tokens the rows hold (sinks and window), not the sequences' lengths."""
        return sum(self._num_held(row) for row in self.rows.values()) * self.bytes_per_token

    # -- per step ----------------------------------------------------------------------------------
    def prepare(self, step: StepInputs) -> list[int]:
        keys: list[int] = []       # per sequence: tokens in its row once this step's are written
        shifts: list[int] = []     # per sequence: absolute position - row index of this step's tokens
        for seq, num_new, context in zip(step.seqs, step.query_lens, step.context_lens):
            row = self.rows[seq.seq_id]
            start = context - num_new                       # position of the step's first token
            if start != row.length:
                raise RuntimeError(f"sequence {seq.seq_id}'s step starts at position {start} but its row "
                                   f"accounts for {row.length} tokens")
            self._evict(row)
            held = self._num_held(row)
            shifts.append(start - held)
            keys.append(held + num_new)
            row.length = context
        self.peak_tokens_held = max(self.peak_tokens_held, max(keys))
        self.plan_rows([self.rows[s.seq_id].slot for s in step.seqs], step, shifts)
        return keys          # attention reads each row's held tokens; positions stay absolute (RoPE)

    def stats(self) -> dict[str, float]:
        return {"kv_capacity_tokens": self.capacity, "kv_peak_reserved_bytes": self.peak_reserved,
                "tokens_evicted": self.tokens_evicted, "peak_tokens_held": self.peak_tokens_held,
                "max_seqs_admitted": self.max_seqs_admitted}
