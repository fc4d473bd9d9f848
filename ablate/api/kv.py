"""What a KV cache stores (KVSpec), what attention reads from it (the views), and its memory budget.

Every view can hand out the keys and values padded per sequence, (B, S, H_kv, D) with S >= the
step's longest kv_len, which is what the generic attention paths (naive, sdpa) use. Kernels that
understand a layout natively (paged decode) take the view as it is. A view holds K/V in the
model's dtype: a cache that stores them compressed (int8, say) dequantises in `view`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import psutil
import torch

from ablate.api.plugin import PluginConfig
from ablate.api.step import StepInputs

if TYPE_CHECKING:
    from ablate.api.context import EngineConfig


def kv_bytes_per_token(num_layers: int, n_kv_heads: int, k_width: int, v_width: int, element_bytes: int) -> int:
    """2 x layers x kv_heads x head_dim x dtype bytes, written for K and V widths that may differ
    (MLA: layers x (latent + rotary key) x dtype bytes, one "head", nothing in V). The one formula:
    KVSpec and ModelConfig both call it."""
    return num_layers * n_kv_heads * (k_width + v_width) * element_bytes


@dataclass(frozen=True)
class KVSpec:
    """The shape of what a KV cache stores per token and layer, and the most it must hold."""

    num_layers: int
    n_kv_heads: int
    k_head_dim: int           # MLA stores a latent + rotary key here and nothing in V
    v_head_dim: int
    dtype: torch.dtype        # what the model writes and attention reads
    device: torch.device
    max_num_seqs: int         # engine.max_num_seqs: sequences at once
    max_seq_len: int          # the workload's longest prompt + output: no sequence ever holds more
                              # tokens (it stores at most max_num_tokens - 1: its last is never fed)
    windows: tuple[int | None, ...] = ()   # per layer, its sliding window (None: full); (): no windows
    max_step_tokens: int = 0  # the most tokens one sequence feeds in one step; 0: max_seq_len

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token in the model's dtype (kv_bytes_per_token). A cache that stores them
        in another format reports its own (KVCache.bytes_per_token)."""
        return kv_bytes_per_token(self.num_layers, self.n_kv_heads, self.k_head_dim, self.v_head_dim,
                                  self.dtype.itemsize)

    @property
    def layer_bytes_per_token(self) -> int:
        """K/V bytes of one token in one layer (every layer stores the same widths)."""
        return self.bytes_per_token // self.num_layers

    def ring_rows(self, layer: int) -> int | None:
        """Rows a cache keeps per sequence for `layer` when it keeps only the layer's window, as a ring
        (PaddedKV.ring), or None: the layer needs every position (no window, or a ring as long as the
        longest sequence). R = window - 1 + the most tokens a sequence feeds in one step: a step's
        first query still sees its window - 1 keys before it while the step writes its own tokens."""
        window = self.windows[layer] if layer < len(self.windows) else None
        if window is None:
            return None
        rows = window - 1 + (self.max_step_tokens or self.max_seq_len)
        return rows if rows < self.max_seq_len else None

    @classmethod
    def of(cls, model: Any, engine: EngineConfig, max_seq_len: int, max_step_tokens: int | None = None) -> KVSpec:
        """The spec of `model`'s cache. max_step_tokens: the most tokens a sequence feeds in one step,
        by default engine.max_num_batched_tokens (a model session that feeds a whole prompt passes
        max_seq_len)."""
        cfg = model.config
        heads, k_width, v_width = cfg.kv_cache_widths     # MLA: one latent row in K, nothing in V
        windows = tuple(cfg.layer_window(i) for i in range(cfg.n_layers))
        step = engine.max_num_batched_tokens if max_step_tokens is None else max_step_tokens
        return cls(cfg.n_layers, heads, k_width, v_width, cfg.torch_dtype,
                   next(model.parameters()).device, engine.max_num_seqs, max_seq_len,
                   windows if any(w is not None for w in windows) else (), min(step, max_seq_len))


# -- views: what attention reads for one layer ---------------------------------------------------------

@dataclass
class PackedKV:
    """This step's keys and values only, packed like the queries (the `none` cache: no history)."""

    k: torch.Tensor   # (T, H_kv, D)
    v: torch.Tensor   # (T, H_kv, D)
    ring: ClassVar[int] = 0   # padded() puts key j at row j (PaddedKV.ring)

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _ = step.query_pad_index()
        b, s = step.num_seqs, step.max_query_len
        k = self.k.new_zeros(b * s, *self.k.shape[1:]).index_copy_(0, rows, self.k)
        v = self.v.new_zeros(b * s, *self.v.shape[1:]).index_copy_(0, rows, self.v)
        return k.view(b, s, *self.k.shape[1:]), v.view(b, s, *self.v.shape[1:])   # (B, S, H_kv, D)


@dataclass
class PaddedKV:
    """One row per sequence, in batch order, already padded (contiguous, dynamic, streaming caches).
    Entries past a sequence's kv_len are masked out, but must be finite numbers (0 x NaN is NaN).

    ring = 0: key j of a sequence is at row j. ring = R > 0 (a windowed layer whose cache keeps only
    its window): the rows are a ring, S = R, position p at row p mod R, so with L = kv_len row j holds
    position L - 1 - ((L - 1 - j) mod R), none when that is negative. Attention masks such a view by
    those positions: causal_mask(step, S, window, view.ring)."""

    k: torch.Tensor   # (B, S, H_kv, D), S >= the step's longest kv_len (ring: S = ring)
    v: torch.Tensor
    ring: int = 0

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, H_kv, D) each: S = the step's longest kv_len (at most the ring), or every row's whole
        capacity in a step captured for replay (step.graphed), whose lengths the host lists do not hold."""
        if step.graphed:
            return self.k, self.v
        s = min(step.max_kv_len, self.ring) if self.ring else step.max_kv_len   # ring rows past L hold nothing
        return self.k[:, :s], self.v[:, :s]


@dataclass
class PagedKV:
    """A pool of fixed-size blocks and, per sequence, the table of blocks it owns (paged cache).
    A windowed layer's table may name any block for positions before every query's window (blocks the
    cache gave back): those positions must be masked by the window, as causal_mask(step, S, window) does."""

    k_cache: torch.Tensor        # (num_blocks, block_size, H_kv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # (B, max_blocks_per_seq) int32, physical block of each logical block
    ring: ClassVar[int] = 0      # padded() puts key j at row j (PaddedKV.ring)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def padded(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gathered through the block tables, (B, S, H_kv, D) each: S = the step's longest kv_len, or
        every block of the table in a step captured for replay (step.graphed)."""
        if step.graphed:
            table = self.block_tables.long()                               # (B, nb)
            return self.k_cache[table].flatten(1, 2), self.v_cache[table].flatten(1, 2)   # (B, nb * bs, H_kv, D)
        s = step.max_kv_len
        num_blocks = -(-s // self.block_size)
        table = self.block_tables[:, :num_blocks].long()                  # (B, nb)
        k = self.k_cache[table].flatten(1, 2)[:, :s]                       # (B, S, H_kv, D)
        v = self.v_cache[table].flatten(1, 2)[:, :s]
        return k, v


KVView = PackedKV | PaddedKV | PagedKV


@dataclass(frozen=True)
class PagedPlaces:
    """Where a paged cache keeps a decode step's K/V, every layer at once (KVCache.paged_slots): layer l
    writes its token t's k and v to row slot_mapping[g, t] of pool p, flattened to (num_blocks *
    block_size, H_kv, D), and reads pool p through block_tables[g], with (p, g) = layers[l]; that is,
    view(l) is PagedKV(k[p], v[p], block_tables[g])."""

    k: torch.Tensor               # (P, num_blocks, block_size, H_kv, D): the pools
    v: torch.Tensor
    slot_mapping: torch.Tensor    # (G, T) int64, per group of layers sharing block tables
    block_tables: torch.Tensor    # (G, B, max_blocks_per_seq) int32
    layers: tuple[tuple[int, int], ...]    # per layer of the model: (its pool, its group)

    def view(self, layer: int) -> PagedKV:
        pool, group = self.layers[layer]
        return PagedKV(self.k[pool], self.v[pool], self.block_tables[group])

    def slots(self, layer: int) -> torch.Tensor:
        """(T,) int64: the rows of the layer's pool that its tokens' k and v go to."""
        return self.slot_mapping[self.layers[layer][1]]


def view_problem(view: KVView, step: StepInputs, spec: KVSpec) -> str | None:
    """Why `view` cannot be what attention reads for `step`, or None when its shapes fit."""
    if isinstance(view, PackedKV):
        k, v, lead = view.k, view.v, (step.num_tokens,)
        if k.shape[:1] != lead:
            return f"PackedKV holds {k.shape[0]} token rows, the step feeds {step.num_tokens}"
    elif isinstance(view, PaddedKV):
        k, v = view.k, view.v
        if k.dim() != 4 or k.shape[0] != step.num_seqs:
            return f"PaddedKV.k has shape {tuple(k.shape)}, expected (B={step.num_seqs}, S, H_kv, D)"
        if view.ring and k.shape[1] != view.ring:
            return f"PaddedKV rows hold {k.shape[1]} keys, but the view says they are a ring of {view.ring}"
        if not view.ring and k.shape[1] < step.max_kv_len:
            return (f"PaddedKV rows hold {k.shape[1]} keys but a sequence of this step has "
                    f"{step.max_kv_len} (kv_lens {step.kv_lens})")
    elif isinstance(view, PagedKV):
        k, v = view.k_cache, view.v_cache
        tables = view.block_tables
        if tables.dim() != 2 or tables.shape[0] != step.num_seqs:
            return f"PagedKV.block_tables has shape {tuple(tables.shape)}, expected (B={step.num_seqs}, blocks)"
        if tables.shape[1] * view.block_size < step.max_kv_len:
            return (f"PagedKV block tables cover {tables.shape[1] * view.block_size} keys but a sequence of "
                    f"this step has {step.max_kv_len}")
    else:
        return f"a view must be PackedKV, PaddedKV or PagedKV (ablate.api), got {type(view).__name__}"
    want = (spec.n_kv_heads, spec.k_head_dim)
    if tuple(k.shape[-2:]) != want or tuple(v.shape[-2:]) != (spec.n_kv_heads, spec.v_head_dim):
        return (f"K/V heads and widths {tuple(k.shape[-2:])}/{tuple(v.shape[-2:])}, expected "
                f"{want}/{(spec.n_kv_heads, spec.v_head_dim)}")
    if k.dtype != spec.dtype:
        return f"K/V in {k.dtype}, expected the model's {spec.dtype} (dequantise in view())"
    return None


# -- the memory budget every cache can take ----------------------------------------------------------

@dataclass
class KVBudgetConfig(PluginConfig):
    """Base of a cache config that takes a memory budget: a number of bytes, a number of tokens (of
    the model's K/V before any variant, so that one budget holds in any dtype and is the same bytes
    for every variant of a model: an experiment converts it with the arm's model), or a fraction of
    the memory free when the cache is built (device memory on a GPU, available RAM on the CPU).

    A cache honours it by never holding more than `budget_bytes(config, device)` bytes of K/V
    (`bytes_reserved()` stays within it; the kit checks), refusing sequences (`reserve` -> False)
    rather than exceeding it, and raising a ValueError naming `kv_cache.budget_bytes` when it cannot
    hold even one sequence of the workload. A subclass that validates its own fields calls
    `super().__post_init__()` from its __post_init__ so these two are validated too."""

    budget_bytes: int = 0          # most bytes of K/V the cache may hold; 0: see budget_fraction
    budget_fraction: float = 0.0   # or this fraction of free device memory (RAM on the CPU); 0: no limit
    budget_tokens: int = 0         # or the bytes of this many tokens of the model's K/V (before a variant)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"kv_cache.budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.budget_tokens < 0:
            raise ValueError(f"kv_cache.budget_tokens must be >= 0, got {self.budget_tokens}")
        if not 0 <= self.budget_fraction <= 1:
            raise ValueError(f"kv_cache.budget_fraction must be in [0, 1], got {self.budget_fraction}")
        given = [n for n in ("budget_bytes", "budget_tokens", "budget_fraction") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"kv_cache.{' and kv_cache.'.join(given)} are {'both' if len(given) == 2 else 'all'} "
                             "set: give one")


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new KV pool may take: free device memory on a GPU, available RAM on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def budget_bytes(config: KVBudgetConfig, device: torch.device, bytes_per_token: int = 0) -> int:
    """The budget in bytes; 0: no limit. A budget in tokens not already converted by the experiment
    (which uses the model before its variant) counts `bytes_per_token`, the cache's own."""
    if config.budget_fraction:
        return int(config.budget_fraction * free_memory_bytes(device))
    if config.budget_tokens:
        if bytes_per_token <= 0:
            raise ValueError("kv_cache.budget_tokens needs the K/V bytes per token to become bytes: call "
                             "budget_bytes(config, device, spec.bytes_per_token)")
        return config.budget_tokens * bytes_per_token
    return config.budget_bytes
