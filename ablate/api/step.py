"""One engine step: the scheduler's decision (Batch), the tensors of its forward pass (StepInputs)
and the logits that come back (StepLogits)."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from ablate.api.sequence import Sequence


@dataclass
class Batch:
    """Which sequences run this step and how many new tokens each feeds.

    The scheduler builds it with `seqs` and `num_new_tokens`; the engine adds
    `num_lookahead_tokens`, the room the scheduler allocated beyond them: how many extra tokens
    (drafts to verify) decoding may feed for each sequence this step.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]          # tokens each sequence feeds: its prompt (or a chunk of it), 1 when decoding
    num_lookahead_tokens: list[int] = field(default_factory=list)   # filled by the engine; empty: 0 each
    # per sequence: this step feeds it up to its last known token, so it gets logits and emits (False
    # for a prompt chunk that stops short of the prompt's end); set from the sequences when built
    emits: list[bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.seqs) != len(self.num_new_tokens):
            raise ValueError(f"Batch needs one num_new_tokens entry per sequence, got {len(self.seqs)} "
                             f"sequences and {len(self.num_new_tokens)} entries")
        if not self.num_lookahead_tokens:
            self.num_lookahead_tokens = [0] * len(self.seqs)
        self.emits = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def device_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. On a GPU it is staged in pinned memory and copied
    asynchronously: a copy from pageable memory would wait for the GPU to finish its queue first."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype).to(device)       # a CPU (or any other device): no staging


@dataclass
class StepInputs:
    """The tensors of one forward pass, built once per step and read by every layer.

    Queries are packed: sequence b owns rows query_starts[b] : query_starts[b+1] of every (T, ...)
    tensor. Its queries sit at absolute positions context_lens[b] - query_lens[b] ... context_lens[b]-1
    (RoPE uses them). Attention sees kv_lens[b] keys for it: the cache's view after this step's
    K/V are written. kv_lens == context_lens for every cache that keeps all tokens; a cache that
    evicts (a sliding window) reports fewer. The query at row i of sequence b may see the keys
    0 .. kv_lens[b] - query_lens[b] + i (causal, aligned at the end).
    """

    seqs: list[Sequence]
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    query_lens: list[int]          # (B,) tokens fed per sequence
    context_lens: list[int]        # (B,) the sequence's length after this step (positions)
    query_starts: list[int]        # (B+1,) cumulative starts of each sequence's queries
    logits_indices: torch.Tensor   # (N,) rows of the packed hidden states that need logits
    query_starts_t: torch.Tensor   # (B+1,) int32 on the device
    kv_lens: list[int] = field(default_factory=list)      # (B,) keys attention sees; default context_lens
    kv_lens_t: torch.Tensor | None = None                  # (B,) int32 on the device
    # what the KV cache's prepare() decided for this step (slot mapping, block tables, rows) for its
    # write() and view() to read. Kept on the step, not the cache, so that a captured decode graph
    # (engine.graphs) can be replayed for another step: its tensors are copied into the graph's
    # inputs before each replay, and its other values (ints, slices) are part of the graph's key.
    plan: dict[str, Any] = field(default_factory=dict)
    # True while the step is captured into a CUDA graph that later steps of the same shapes replay:
    # the forward may then read per-sequence lengths only from the tensors (kv_lens_t), never from
    # the lists, whose values change between replays
    graphed: bool = False
    # in a part of a step (StepInputs.part): the rows of the whole step its packed rows are, (T_part,)
    rows_in_step: torch.Tensor | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.kv_lens:
            self.kv_lens = list(self.context_lens)
        if self.kv_lens_t is None:
            self.kv_lens_t = device_tensor(self.kv_lens, torch.int32, self.input_ids.device)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token: the batched fast paths apply."""
        return self.max_query_len == 1

    def memo(self, key: str, make):
        """A value derived from this step's shapes, computed by the first layer and reused by the rest."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def memoized(self, key: str):
        """What memo(key, ...) keeps for this step, or None where no layer has asked for it yet."""
        return self._memo.get(key)

    def part(self, seq_indices: list[int]) -> StepInputs:
        """The step restricted to the sequences at `seq_indices` (in that order), for an attention plugin
        that sends kinds of sequences through different kernels (one-query rows through a decode
        kernel, longer ones through a prefill path): their queries' rows, positions and lengths, and
        where those rows sit in this step (rows_in_step). It has no logits rows and no plan, which
        attention does not read. Memoise it on this step: every layer asks for the same parts."""
        if self.graphed:
            raise ValueError("StepInputs.part reads the step's lists, which a replayed graph does not update")
        device = self.input_ids.device
        rows = [r for b in seq_indices for r in range(self.query_starts[b], self.query_starts[b + 1])]
        rows_t = device_tensor(rows, torch.long, device)                            # (T_part,)
        query_lens = [self.query_lens[b] for b in seq_indices]
        starts = [0, *accumulate(query_lens)]
        kv_lens = [self.kv_lens[b] for b in seq_indices]
        return StepInputs(seqs=[self.seqs[b] for b in seq_indices], input_ids=self.input_ids[rows_t],
                          positions=self.positions[rows_t], query_lens=query_lens,
                          context_lens=[self.context_lens[b] for b in seq_indices], query_starts=starts,
                          logits_indices=rows_t[:0], query_starts_t=device_tensor(starts, torch.int32, device),
                          kv_lens=kv_lens, kv_lens_t=device_tensor(kv_lens, torch.int32, device),
                          rows_in_step=rows_t)

    def query_pad_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter packed queries into (B, max_query_len): returns (packed row -> padded row, valid mask)."""
        def make():
            device, lq = self.input_ids.device, self.max_query_len
            # built on the host from the lists: a nonzero() on the device would wait for the GPU
            rows = [b * lq + i for b, n in enumerate(self.query_lens) for i in range(n)]
            lens = device_tensor(self.query_lens, torch.long, device)                 # (B,)
            valid = torch.arange(lq, device=device)[None, :] < lens[:, None]          # (B, Lq)
            return device_tensor(rows, torch.long, device), valid
        return self.memo("query_pad_index", make)


@dataclass(frozen=True)
class StepLogits:
    """What a forward pass returns: logits (N, V) fp32, and how many rows each sequence owns.

    Sequence i (batch order) owns rows starts[i] : starts[i] + rows[i]: none for a prompt chunk
    that stops short of its end, one for its last token, and one more per draft token fed after it.
    """

    logits: torch.Tensor    # (N, V) fp32
    rows: list[int]         # (B,)

    @property
    def starts(self) -> list[int]:
        out = [0]
        for r in self.rows:
            out.append(out[-1] + r)
        return out

    def of(self, i: int) -> torch.Tensor:
        """Sequence i's rows (rows[i], V): the target's logits at its last token and after each draft."""
        start = sum(self.rows[:i])
        return self.logits[start:start + self.rows[i]]
