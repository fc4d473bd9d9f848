"""What paging buys, predicted from the length distribution: KV utilisation and sequences held at once.

A sequence holding L tokens reserves R(L) token slots:
  paged, block size b:  R(L) = b * ceil(L / b)   -> wastes (b - 1) / 2 slots on average (L mod b uniform)
  contiguous:           R(L) = L_max             (a paged cache whose only block is the maximum length)
A request with prompt p and output o holds L = p, p + 1, ..., p + o - 1 tokens after each of its o
steps (the last emitted token is never fed back). Averaged over all steps of all requests, the
time weighting the measurement uses (longer requests live longer and count more):
  utilisation           U = E[L] / E[R(L)]
  sequences at once     N = min(max_num_seqs, floor(budget_tokens / E[R(L)]))   (steady state: the pool is full)
  fragmentation         F = E[R(L) - L] slots per sequence (about b / 2)
With sliding windows the paged cache keeps one table per group of layers (layer_groups.py), and a
windowed group holds only the blocks from the window's first position on, L - W + 1 (after a step, the
next query's window), so a sequence reserves the sum over groups of
  full group:      R(L) = b * ceil(L / b)                         and uses L
  window W:        R(L) = b * (ceil(L / b) - floor(max(0, L - W + 1) / b))   and uses min(L, W)
slots, in units of one group's layers; U and N take those sums, F (a table's last block) stays.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ablate.api import Stat

# what a cache that reports the prediction declares (`predicts`: the measured column beside it)
PREDICTION_STATS = (
    Stat("predicted_kv_util", "KV used / reserved the paging model predicts", "fraction",
         table="KV cache", predicts="kv_util_mean"),
    Stat("predicted_seqs_admitted", "sequences held at once the paging model predicts", "count",
         table="KV cache", predicts="seqs_admitted_while_queued"),
    Stat("predicted_frag_slots_per_seq", "reserved slots holding no token, per sequence, predicted", "tokens",
         table="KV cache", predicts="kv_cache.kv_frag_slots_per_seq_mean"),
)


def live_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> np.ndarray:
    """Every length a request holds after one of its steps, over all requests (one entry per step)."""
    prompt = np.asarray(prompt_lens, dtype=np.int64)
    output = np.asarray(output_lens, dtype=np.int64)
    start = np.repeat(prompt, output)                                    # (sum o,)
    offsets = np.arange(output.sum()) - np.repeat(np.cumsum(output) - output, output)   # 0..o-1 per request
    return start + offsets


def reserved_tokens(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """R(L) = block_size * ceil(L / block_size)."""
    return -(-lengths // block_size) * block_size


def windowed_reserved_tokens(lengths: np.ndarray, block_size: int, window: int) -> np.ndarray:
    """R(L) of a group with a sliding window W: the blocks from position L - W + 1's on."""
    first = np.maximum(0, lengths - window + 1) // block_size
    return (-(-lengths // block_size) - first) * block_size


def predict(prompt_lens: Sequence[int], output_lens: Sequence[int], block_size: int, budget_tokens: int,
            max_num_seqs: int, windows: Sequence[int | None] = (None,)) -> dict[str, float]:
    """Predicted utilisation, sequences held at once and slots wasted per sequence.

    For a contiguous cache pass block_size = the maximum length (every sequence reserves one such block).
    windows: per group of layers (the paged cache's), its sliding window or None; budget_tokens counts
    one group's slots (num_blocks x block_size).
    """
    lengths = live_lengths(prompt_lens, output_lens)
    if lengths.size == 0:
        return {"predicted_kv_util": float("nan"), "predicted_seqs_admitted": float("nan"),
                "predicted_frag_slots_per_seq": float("nan")}
    reserved = reserved_tokens(lengths, block_size)
    all_reserved = sum(reserved if w is None else windowed_reserved_tokens(lengths, block_size, w) for w in windows)
    used = sum(lengths if w is None else np.minimum(lengths, w) for w in windows)
    mean_reserved = float(all_reserved.mean())
    held = min(float(max_num_seqs), budget_tokens // mean_reserved) if budget_tokens else float(max_num_seqs)
    return {"predicted_kv_util": float(used.mean()) / mean_reserved,
            "predicted_seqs_admitted": min(held, float(len(prompt_lens))),
            "predicted_frag_slots_per_seq": float((reserved - lengths).mean())}
