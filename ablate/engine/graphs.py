"""engine.graphs: decode steps captured once per batch shape and replayed.

An eager decode step launches ~10 kernels a layer from Python. For a small model on a GPU the
launches, not the weights, then set the step time (llama-3.2-1b in bf16 reads its 2.5 GB of weights
in ~0.6 ms on an H200, while its eager step took ~9 ms here), so every technique's speedup would
measure Python. A CUDA graph records a step's kernels once and replays them with one launch, as
nano-vllm and vLLM do. On a CPU there is no launch to save; there the same option compiles the
layers' dense arithmetic with torch.compile (Inductor's C++ backend: norms, RoPE and the SwiGLU
fused around the matrix products), so the path is exercised and measured here too.

What is captured: decode steps (one new token per sequence, no drafts) of an arm whose KV cache and
attention declare `graph_safe`. A graph is keyed by everything that fixes its shapes and addresses:
the batch size, the shapes of the step's tensors, and the cache plan's other values (a slice of
rows, a storage address). Before each replay the live step's tensors are copied into the graph's.

Trust, but verify: the first time a graph replays a step other than the one it was captured on, the
step also runs eagerly and the logits must agree to within rounding (replay_agrees). A plugin that
reads a per-step Python value would diverge there; the arm then runs eagerly from that step on, and
says why.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ablate.api.step import StepInputs

STEP_TENSORS = ("input_ids", "positions", "logits_indices", "query_starts_t", "kv_lens_t")   # copied per replay


def graph_mode(device: torch.device, enabled: bool) -> str:
    """What engine.graphs does on this device: "cuda-graphs", "compile" or "eager"."""
    if not enabled:
        return "eager"
    return "cuda-graphs" if device.type == "cuda" else "compile"


def why_not_capturable(kv_cache, attention) -> str | None:
    """Why an arm's decode steps cannot be captured, or None when they can."""
    if not kv_cache.keeps_kv:
        return f"kv_cache={kv_cache.name} keeps no K/V: every step feeds the whole prefix"
    for plugin in (kv_cache, attention):
        if not plugin.graph_safe:
            return f"{plugin.slot.value}={plugin.name} does not declare graph_safe"
    return None


# A replay and the eager step compute the same logits with different kernels (cuBLAS picks a GEMM
# algorithm per stream and workspace; a captured split-K may reduce in another order), so they agree
# to rounding, not bit for bit. Rounding in a dot product scales with its terms, not its result (a
# logit near 0 carries the error of the largest ones), so the bound is per row, on the row's scale
# s = max_j |eager_j|, with u the relative precision of the model's arithmetic:
#
#     |replay_j - eager_j| <= REPLAY_TOLERANCE_ULPS * u * s        for every logit j of the row,
#     u = max(eps(dtype), 2^-16)
#
# eps: the dtype's machine epsilon (bf16 2^-7, fp16 2^-10: eps * s is one to two ulps of s), the
# rounding of every stored activation; products accumulate in fp32 underneath. In fp32 that
# accumulation is the whole error: a sum of n terms reordered moves by ~sqrt(n) fp32 ulps of its
# terms, up to ~2^-16 relative for n ~ 2^14 (d_ff of an 8B model); measured 4.2 x 2^-23 on `tiny`.
#
# Why 4: re-rounded activations move the final hidden state h by ~eps |h|, so a logit w_j . h by
# ~eps |w_j| |h| / sqrt(d) times a little growth through the layers, while the top logit is
# s ~ c |w_j| |h| / sqrt(d) with c >= sqrt(2 ln V) ~ 4.9 (the largest of V = 128k random projections;
# trained models sit higher): rounding stays near eps * s. A step that reads other K/V changes h by
# O(|h|) and its logits by ~s / c ~ 20% of s, 6x the bf16 bound (1e-3 absolute + relative, the rule
# before, is under one bf16 ulp of a logit of 200 and turned graphs off on any cuBLAS difference).
REPLAY_TOLERANCE_ULPS = 4
FP32_ACCUMULATION_PRECISION = 2.0 ** -16


def replay_precision(dtype: torch.dtype) -> float:
    """u: the relative precision of a model's arithmetic in `dtype` (the unit of the bound above)."""
    return max(torch.finfo(dtype).eps, FP32_ACCUMULATION_PRECISION)


def replay_tolerance(eager: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """eager (N, V) logits of a model computing in `dtype` -> (N, 1) the bound on each row's error."""
    return REPLAY_TOLERANCE_ULPS * replay_precision(dtype) * eager.abs().amax(dim=-1, keepdim=True)


def replay_agrees(replayed: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a replay's logits (N, V) equal the eager step's up to rounding in `dtype` (one sync)."""
    return bool(((replayed - eager).abs() <= replay_tolerance(eager, dtype)).all())


def graph_key(step: StepInputs) -> tuple:
    """What fixes a captured graph: the batch size, the plan's tensor shapes and its other values."""
    parts: list = [step.num_seqs]
    for name, value in sorted(step.plan.items()):
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype))
        elif isinstance(value, slice):
            parts.append((name, value.start, value.stop, value.step))
        else:
            parts.append((name, value))
    return tuple(parts)


@dataclass
class _Graph:
    step: StepInputs                          # the graph's own inputs: live values are copied in
    logits: torch.Tensor | None = None        # (B, V) the graph's output
    graph: torch.cuda.CUDAGraph | None = None  # None when emulated
    verified: bool = False


class DecodeGraphs:
    """CUDA graphs of one arm's decode steps: `run(step, forward)` replays (capturing on first sight)
    the graph of the step's key; `forward(step) -> logits` is the eager step it stands for.

    compute_dtype: the dtype the model computes in (its parameters'), which sets how closely a replay
    must agree with the eager step (replay_agrees). emulate=True (tests on a CPU): a "replay" runs
    `forward` on the graph's own step, whose lists keep the values of the step it was captured on,
    exactly what a real graph bakes in; so a plugin that is not graph-safe is caught on a machine
    without a GPU."""

    def __init__(self, device: torch.device, unsupported: str | None, *, compute_dtype: torch.dtype,
                 emulate: bool = False) -> None:
        self.device = device
        self.compute_dtype = compute_dtype
        self.emulate = emulate
        self.disabled = unsupported            # why this arm runs eagerly (None: it captures)
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if unsupported is None and not emulate else None
        self.num_captures = self.num_replays = self.num_eager = 0
        self.capture_s = 0.0                   # spent capturing (inside the run that met each shape first)

    def run(self, step: StepInputs, forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        if self.disabled is not None or not step.is_decode:
            self.num_eager += 1
            return forward(step)
        key = graph_key(step)
        graph = self.graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            try:
                return self._capture(key, step, forward)
            finally:
                self.capture_s += time.perf_counter() - start
        for name in STEP_TENSORS:
            getattr(graph.step, name).copy_(getattr(step, name), non_blocking=True)
        for name, value in step.plan.items():
            if isinstance(value, torch.Tensor):
                graph.step.plan[name].copy_(value, non_blocking=True)
        if self.emulate:
            logits = forward(replace(graph.step, _memo={}))
        else:
            graph.graph.replay()
            logits = graph.logits.clone()      # the next replay overwrites the graph's output
        self.num_replays += 1
        if not graph.verified:
            graph.verified = True
            expected = forward(step)           # rewrites the same K/V with the same values
            if not replay_agrees(logits, expected, self.compute_dtype):
                self.disabled = ("a replayed graph disagreed with the eager step: a plugin reads a per-step "
                                 "value outside step.plan and the step's tensors")
                self.graphs.clear()
                return expected
        return logits

    def _capture(self, key: tuple, live: StepInputs, forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """Capture the step's graph; returns the step's logits (from the warm-up run, which is eager)."""
        step = replace(live, plan={n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in live.plan.items()},
                       graphed=True, _memo={}, **{n: getattr(live, n).clone() for n in STEP_TENSORS})
        self.num_captures += 1
        if self.emulate:
            self.graphs[key] = _Graph(step)
            return forward(replace(step, _memo={}))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):           # warm-up off the capture: kernels compile and tune here
            logits = forward(replace(step, _memo={}))
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(replace(step, _memo={}))
        except RuntimeError as err:            # a sync or a pageable copy the capture refuses
            self.disabled = f"capture failed: {str(err).splitlines()[0]}"
            self.graphs.clear()
            return logits
        self.graphs[key] = _Graph(step, out, graph)
        return logits

    def stats(self) -> dict[str, str | int]:
        state = "cuda-graphs" if self.disabled is None else f"eager ({self.disabled})"
        return {"graphs": state, "graph_captures": self.num_captures, "graph_replays": self.num_replays,
                "graph_eager_steps": self.num_eager, "graph_capture_s": self.capture_s}

    def close(self) -> None:
        self.graphs.clear()
