"""Tile configs of the prefill kernel, chosen by timing on the machine at hand.

The best (BLOCK_M, BLOCK_N, num_warps, num_stages) differs between GPUs, Triton versions, head dims
and sequence lengths, so it is measured rather than fixed: triton.autotune times a few candidates the
first time it sees a key, and later calls launch the winner directly (no per-call autotuner dispatch).
The key is HEAD_DIM, CAUSAL, the dtype-dependent constexprs (DOT_UPCAST, PRECISION; autotune adds the
tensors' dtypes itself) and seqlen_q_bucket, max_seqlen_q rounded up to a power of two, so a run tunes
once per bucket, during its warm-up, and never per call. Each candidate is one compiled variant, so
the number of variants stays bounded (see variants.compiled_variants).

Not tuned: fp32 (a correctness path with IEEE dots, kept on small tiles) and the Triton interpreter
(CPU tests), which runs exactly _INTERPRETER_CONFIG: small unequal tiles, so tests cross several
query and key tiles and the causal diagonal.

Hopper notes. The kernel uses exp2 with log2(e) folded into the score scale (one FMA per score), splits causal
rows into unmasked full key tiles and one masked diagonal stretch, and starts the longest (last)
query tiles first. The key loop is software-pipelined by the kernel-level num_stages (tuned here);
tl.range(..., warp_specialize=True) is left out: Triton 3.6 documents it for Blackwell only.
"""

from __future__ import annotations

import functools

import torch
import triton

from .online_softmax import _INTERPRETED

_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
_FP32_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class (head_dim <= class). The first
# is the default where no timing is done (an explicit single choice). Shared memory per program is about
# (BLOCK_M + 2 * num_stages * BLOCK_N) * head_dim * 2 bytes; candidates that do not fit a GPU fail to
# compile there and the autotuner skips them (timed as inf). On an H200 (triton 3.6, bf16, causal, H=32,
# H_kv=8, 4k-16k tokens) 64x64 w4 s3 and 128x64 w8 s3/s4 were fastest, within a few % of each other; 128x32
# (d <= 64) and 128x64 w4 / 128x32 (d = 128) were slowest at every length and were dropped.
_CANDIDATES = {
    64: ((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3)),
    128: ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2)),
    256: ((64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3)),
}
_MIN_BUCKET = 128  # shorter prefills share one tuning: they are launch bound, tiles matter little
_AUTOTUNE_KEY = ["seqlen_q_bucket", "HEAD_DIM", "CAUSAL", "DOT_UPCAST", "PRECISION"]

_last_config: dict | None = None  # the tile config of the latest prefill launch (see last_prefill_config)
# (head_dim, dtype, causal, bucket) -> launch kwargs the autotuner picked: later calls launch the kernel with
# them directly, skipping the autotuner's per-call dispatch (host time that shows in short prefills)
_picked: dict[tuple, dict] = {}


def _head_dim_class(head_dim: int) -> int:
    return next(bound for bound in sorted(_CANDIDATES) if head_dim <= bound)


def _config(tiles: tuple[int, int, int, int]) -> triton.Config:
    block_m, block_n, num_warps, num_stages = tiles
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


def prefill_candidates(head_dim: int, dtype: torch.dtype) -> list[dict]:
    """The tile configs prefill may use for this head dim and dtype (a single one where none is timed),
    as launch kwargs. Timed candidates carry exactly the kwargs the autotuner launches with (num_ctas
    included), so an explicit launch reuses the variant compiled while tuning instead of compiling a twin."""
    return [dict(kwargs) for kwargs in _candidates(head_dim, dtype)]


@functools.lru_cache(maxsize=None)
def _candidates(head_dim: int, dtype: torch.dtype) -> tuple[dict, ...]:  # shared: never mutate
    if _INTERPRETED:
        return (_INTERPRETER_CONFIG,)
    if dtype == torch.float32:
        return (_FP32_CONFIG,)
    return tuple(_config(tiles).all_kwargs() for tiles in _CANDIDATES[_head_dim_class(head_dim)])


def seqlen_bucket(max_seqlen_q: int) -> int:
    """The autotune bucket of a prefill: max_seqlen_q rounded up to a power of two, at least _MIN_BUCKET."""
    return max(_MIN_BUCKET, triton.next_power_of_2(max(max_seqlen_q, 1)))


def autotuners(kernel) -> dict:
    """{head-dim class: triton.autotune(kernel) over that class's candidates}; {} under the interpreter.

    The autotuners share `kernel`'s compile cache, so a config compiled while tuning is reused after.
    """
    if _INTERPRETED:
        return {}
    return {
        bound: triton.autotune(configs=[_config(t) for t in tiles], key=_AUTOTUNE_KEY)(kernel)
        for bound, tiles in _CANDIDATES.items()
    }


def select_prefill(kernel, tuned: dict, head_dim: int, dtype: torch.dtype, causal: bool, bucket: int,
                   config: dict | None):
    """(launchable, launch kwargs, pick key) for a prefill launch.

    config given: exactly that config on the plain kernel (tests and benchmark sweeps). Where nothing
    is timed (interpreter, fp32): the plain kernel with the single candidate. Otherwise, once the
    autotuner has picked for this key, the plain kernel with its pick; before that, the autotuner of
    the head-dim class with no tile kwargs (it times the candidates, then adds the winner's) and the
    key under which record_prefill keeps the pick.
    """
    if config is not None:
        return kernel, dict(config), None
    candidates = _candidates(head_dim, dtype)
    if len(candidates) == 1 or not tuned:
        return kernel, candidates[0], None
    key = (head_dim, dtype, bool(causal), bucket)
    if key in _picked:
        return kernel, _picked[key], None
    return tuned[_head_dim_class(head_dim)], {}, key


def record_prefill(launched, kwargs: dict, key: tuple | None) -> None:
    """Remember the config the latest prefill ran with, and the autotuner's pick for its key."""
    global _last_config
    if not kwargs:
        kwargs = launched.best_config.all_kwargs()  # set by triton's Autotuner.run on every call
        if key is not None:
            _picked[key] = kwargs
    _last_config = {name: kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}


def last_prefill_config() -> dict | None:
    """BLOCK_M, BLOCK_N, num_warps, num_stages of the latest flash_attention_varlen launch in this
    process (None before the first), e.g. for a benchmark to record what the autotuner picked."""
    return None if _last_config is None else dict(_last_config)
