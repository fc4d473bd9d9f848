"""What speculative decoding's verify pass costs against one decode step, by draft length k.

The target checks k drafts in ONE forward pass over k + 1 new tokens (the pending token and the k
drafts) on top of a cached context of c tokens, with logits at all k + 1 positions: exactly
`Executor.forward(batch, {seq: drafts})` as decoding=speculative calls it. Its cost is compared with
the one-token decode step at the same context (the same call without drafts). Speculation's
speedup formula assumes the ratio

    ratio(k) = time(verify pass of k + 1 tokens) / time(one-token step)

is ~1: every projection reads its weights once for all k + 1 tokens (a matrix-matrix product in
place of a matrix-vector one), so while a step is bound by the bytes it reads, k more tokens add
almost no time; once the pass's FLOPs take longer than its bytes it grows ~linearly in k.

Roofline prediction (ablate.analysis.analytic.CostModel, peaks B bytes/s and F FLOP/s of this
machine, ablate.measure.hardware.peaks):

    time(q) = max(bytes(q) / B, FLOPs(q) / F)      q = k + 1 queries over c + k + 1 keys
    predicted_ratio(k) = time(k + 1) / time(1)

Measurement: after a warm-up, `rounds` rounds; in each, for every k, the step and the verify pass
alternate `passes_per_round` times each (A B A B ..., the order flipped every other round so that
drift falls on both alike) and each takes the median of its passes. ratio(k) is the geometric mean
over rounds of the per-round ratio with its t-interval (ablate.analysis.stats.log_interval); the
times are medians over rounds. After every pass the cache is rolled back to the c context tokens
(KVCache.commit), as the engine does with rejected drafts, so every pass sees the same context.
Both kinds of pass run eagerly (engine.graphs off): CUDA graphs would replay only the one-token
step, so with them a step costs less than here and the ratio is higher. On a GPU every pass is
timed between two device synchronisations.

The knee (`knee`): the largest k such that ratio(k') <= tolerance for every k' <= k (default 1.2:
a verify pass within 20% of a step); 0 when k = 1 already costs more. Flat up to the knee means
the speedup formula's assumption holds there.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from ablate.analysis.analytic import CostModel
from ablate.analysis.stats import log_interval
from ablate.api import clock
from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.api.step import Batch
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry, default_registry
from ablate.engine.session import Shadow
from ablate.measure import hardware
from ablate.model.llama import LlamaModel

KNEE_TOLERANCE = 1.2     # a verify pass within 20% of a one-token step counts as "about one step"


class CachedContext:
    """One sequence whose first `context` tokens are in the arm's KV cache, and a pending token.

    step(), verify(drafts) and decode(drafts) feed what follows and roll the cache back to the
    context afterwards, so each call sees the same state."""

    def __init__(self, built: BuiltArm, context_ids: list[int], pending: int) -> None:
        self.runner, self.cache = built.engine.runner, built.kv_cache
        self.context = len(context_ids)
        self.tokens = [*context_ids, pending]                      # the known tokens: context + pending
        self.seq = Shadow(Request(0, tuple(self.tokens), max_new_tokens=1))
        self.seq.sync(self.tokens, 0)
        self._feed(self.context)                                   # prefill: no logits (not the last token)
        self._reset()

    def _feed(self, num_new: int, drafts: list[int] | None = None) -> torch.Tensor:
        lookahead = len(drafts or ())
        if not self.cache.allocate(self.seq, num_new, lookahead):
            raise ValueError(f"the KV cache has no room for {self.seq.num_computed_tokens + num_new + lookahead} "
                             "tokens of one sequence: give the kv_cache no budget, or a shorter context")
        batch = Batch([self.seq], [num_new], [lookahead])
        return self.runner.forward(batch, {self.seq.seq_id: drafts} if drafts else None).logits

    def _reset(self) -> None:
        self.seq.sync(self.tokens, self.context)
        self.cache.commit(self.seq, self.context)                  # forget what was fed after the context

    def step(self) -> torch.Tensor:
        """The one-token decode step: the pending token over the context. Logits (1, V)."""
        try:
            return self._feed(1)
        finally:
            self._reset()

    def verify(self, drafts: list[int]) -> torch.Tensor:
        """The verify pass: pending token + drafts in one forward. Logits (k + 1, V): row j predicts
        the token after draft j (row 0: after the pending token)."""
        try:
            return self._feed(1, drafts)
        finally:
            self._reset()

    def decode(self, drafts: list[int]) -> torch.Tensor:
        """The same k + 1 tokens fed one per step, as autoregressive decoding would: logits (k + 1, V)."""
        rows = []
        try:
            for j in range(len(drafts) + 1):
                self.seq.sync([*self.tokens, *drafts[:j]], self.context + j)
                rows.append(self._feed(1))
                self.seq.sync(self.seq.token_ids, self.context + j + 1)
                self.cache.commit(self.seq, self.context + j + 1)
        finally:
            self._reset()
        return torch.cat(rows)

    def release(self) -> None:
        self.cache.release(self.seq)


@dataclass(frozen=True)
class Roofline:
    """Predicted seconds of a pass: max(bytes / B, FLOPs / F)."""

    costs: CostModel
    peaks: hardware.Peaks

    def seconds(self, query: int, keys: int) -> tuple[float, str]:
        cost = self.costs.step([query], [keys], query)
        memory, compute = cost.bytes / self.peaks.bandwidth_bytes_s, cost.flops / self.peaks.flops
        return max(memory, compute), "memory" if memory >= compute else "compute"


def build_verify_arm(model: LlamaModel, num_tokens: int, kv_cache: str = "contiguous", attention: str = "sdpa",
                     registry: Registry | None = None) -> BuiltArm:
    """The engine's plugins around `model` for one sequence of up to `num_tokens` tokens: the given
    cache and attention, the baseline's other slots (no model variant), eager (no CUDA graphs)."""
    registry = registry or default_registry()
    arm = resolve_arm("verify", {"kv_cache": kv_cache, "attention": attention}, baseline_configs(registry), registry)
    engine = EngineConfig(max_num_seqs=1, max_num_batched_tokens=max(num_tokens, 4096))
    return build_arm(arm, model, engine, num_tokens, registry)


def _checked_ks(ks: Iterable[int]) -> list[int]:
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"ks must be draft lengths, whole numbers >= 1 (e.g. range(1, 17)), got {ks}")
    return sorted({int(k) for k in ks})


def _peaks(peaks: hardware.Peaks | str | None, model: LlamaModel, device: torch.device) -> hardware.Peaks | None:
    """'auto': this machine's peaks (cached or measured), None when a running sweep froze them."""
    if isinstance(peaks, hardware.Peaks) or peaks is None:
        return peaks
    try:
        return hardware.peaks(device, model.config.torch_dtype)
    except hardware.PeaksUnavailable:
        return None


def _timed(fn, device: torch.device) -> float:
    start = clock.now(device)                # on a GPU: after the queue drains, and again after the pass
    fn()
    return clock.now(device) - start


def verify_cost(model: LlamaModel, context: int = 256, ks: Iterable[int] = range(1, 17), rounds: int = 5,
                passes_per_round: int = 3, warmup: int = 2, kv_cache: str = "contiguous", attention: str = "sdpa",
                peaks: hardware.Peaks | str | None = "auto", registry: Registry | None = None,
                seed: int = 0) -> pd.DataFrame:
    """Time the verify pass over k + 1 tokens against a one-token step, at `context` cached tokens,
    for every k in `ks` (module docstring). One row per k: k, tokens (k + 1), context, verify_ms and
    step_ms (medians over rounds), ratio with ratio_ci_low / ratio_ci_high (95%, NaN under 3 rounds)
    and rounds, then the roofline's predicted_verify_ms, predicted_step_ms, predicted_ratio and the
    verify pass's bound (memory | compute); NaN / "" without peaks (peaks=None, or none available)."""
    ks = _checked_ks(ks)
    for name, value, low in (("context", context, 1), ("rounds", rounds, 1), ("passes_per_round", passes_per_round, 1),
                             ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    if not (peaks == "auto" or peaks is None or isinstance(peaks, hardware.Peaks)):
        raise ValueError(f"peaks must be 'auto' (measured or cached on this machine), a Peaks, or None (no "
                         f"roofline prediction), got {peaks!r}")
    need = context + max(ks) + 1
    if need > model.config.max_seq_len:
        raise ValueError(f"context {context} + k {max(ks)} + 1 = {need} tokens exceeds the model's max_seq_len "
                         f"{model.config.max_seq_len}: shorten the context or the largest k")
    built = build_verify_arm(model, need, kv_cache, attention, registry)
    device = built.engine.device
    costs = CostModel(model.config, built.kv_cache.keeps_kv, built.kv_cache.bytes_per_token)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (need,), generator=gen, device="cpu").tolist()
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}       # k -> (step s, verify s) per round
    try:
        with torch.inference_mode():
            ctx = CachedContext(built, ids[:context], ids[context])
            drafts = ids[context + 1:]
            for _ in range(warmup):
                ctx.step()
                for k in ks:
                    ctx.verify(drafts[:k])
            for r in range(rounds):
                for k in ks if r % 2 == 0 else ks[::-1]:
                    arms = [lambda: ctx.step(), lambda k=k: ctx.verify(drafts[:k])]
                    samples: list[list[float]] = [[], []]
                    for p in range(passes_per_round):
                        order = (0, 1) if (r + p) % 2 == 0 else (1, 0)
                        for i in order:
                            samples[i].append(_timed(arms[i], device))
                    times[k].append((statistics.median(samples[0]), statistics.median(samples[1])))
            ctx.release()
    finally:
        built.close()
    found = _peaks(peaks, model, device)
    roofline = Roofline(costs, found) if found is not None else None
    return pd.DataFrame([_row(k, context, times[k], roofline) for k in ks])


def _row(k: int, context: int, pairs: list[tuple[float, float]], roofline: Roofline | None) -> dict[str, Any]:
    steps, verifies = np.array(pairs).T
    ratio = log_interval(verifies / steps)
    row: dict[str, Any] = {"k": k, "tokens": k + 1, "context": context,
                           "verify_ms": float(np.median(verifies)) * 1e3, "step_ms": float(np.median(steps)) * 1e3,
                           "ratio": ratio.center, "ratio_ci_low": ratio.low, "ratio_ci_high": ratio.high,
                           "rounds": ratio.n, "predicted_verify_ms": np.nan, "predicted_step_ms": np.nan,
                           "predicted_ratio": np.nan, "bound": ""}
    if roofline is not None:
        verify_s, bound = roofline.seconds(k + 1, context + k + 1)
        step_s, _ = roofline.seconds(1, context + 1)
        row |= {"predicted_verify_ms": verify_s * 1e3, "predicted_step_ms": step_s * 1e3,
                "predicted_ratio": verify_s / step_s, "bound": bound}
    return row


def knee(frame: pd.DataFrame, tolerance: float = KNEE_TOLERANCE, column: str = "ratio") -> int:
    """The largest k such that `column` (the measured ratio; predicted_ratio for the roofline's) is at
    most `tolerance` for every k' <= k in the frame: where the verify pass stops costing about one
    step. 0 when the smallest k already exceeds it; a NaN ratio ends the flat run."""
    if not (isinstance(tolerance, (int, float)) and np.isfinite(tolerance) and tolerance >= 1):
        raise ValueError(f"tolerance must be a ratio >= 1 (1.2: within 20% of a one-token step), got {tolerance!r}")
    missing = {"k", column} - set(frame.columns)
    if missing:
        raise ValueError(f"knee needs a verify_cost frame with columns k and {column}; missing {sorted(missing)}")
    flat = 0
    for k, ratio in frame.sort_values("k")[["k", column]].itertuples(index=False):
        if not ratio <= tolerance:           # NaN is not flat either
            break
        flat = int(k)
    return flat
