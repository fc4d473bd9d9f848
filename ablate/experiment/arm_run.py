"""One arm measured once: its engine built afresh, the requests served, the figures of that run
(ablate.measure.metrics), and the arm's perplexity on held-out text for the quality guardrail."""
from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pandas as pd

from ablate.analysis.analytic import CostModel
from ablate.api import clock, tuning
from ablate.api.context import EngineConfig
from ablate.api.kv import KVBudgetConfig
from ablate.api.plugin import Slot
from ablate.api.sequence import Request
from ablate.engine.arm import Arm, build_arm
from ablate.engine.registry import Registry
from ablate.measure import device as dev
from ablate.measure.hardware import Peaks
from ablate.measure.memory import TensorMemoryTracker, cuda_peak_since, resident_weight_bytes, start_cuda_peak
from ablate.measure.metrics import ArmRun, request_table, roofline, summarise
from ablate.measure.quality import runner_perplexity
from ablate.measure.recorder import Recorder
from ablate.model.linear import copy_bytes
from ablate.model.llama import LlamaModel
from ablate.model.product_paths import PRODUCT_PATHS


def expects_baseline_tokens(arm: Arm, baseline: Arm, registry: Registry) -> bool:
    """Every plugin the arm changes is declared exact, on the same model: its greedy tokens must be
    the baseline's."""
    if arm.name == baseline.name or arm.model_overrides != baseline.model_overrides or baseline.outside is not None:
        return False
    if arm.outside is not None:     # an outside engine on the same weights and precision (its own declaration)
        return arm.outside[0].is_exact(arm.outside[1])
    return all(registry.get(slot, config.name).exact for slot, config in arm.plugins.items()
               if config != baseline.plugins[slot])


def with_fixed_kv_budget(arm: Arm, free_bytes: int | None, model_for: Callable[[Arm], LlamaModel]) -> Arm:
    """The arm with its KV budget in bytes, the same for every arm of the job:
    - kv_cache.budget_tokens: that many tokens of the arm's model before its variant (so a GQA, MQA
      or MLA arm gets the bytes the model it converts would hold, in whatever dtype it runs);
    - kv_cache.budget_fraction: of one reading of free memory taken at the job's start (before any
      arm: what earlier arms leave in the allocator's cache must not shrink later arms' budgets),
      less the arm's model, as if the arm ran alone:
      budget_bytes = budget_fraction x (free at the start - the arm's model's weight bytes)."""
    config = arm.plugins.get(Slot.KV_CACHE)
    if not isinstance(config, KVBudgetConfig):
        return arm
    if config.budget_tokens:
        budget = config.budget_tokens * model_for(arm).config.kv_bytes_per_token()
    elif free_bytes is not None and config.budget_fraction:   # at least 1 byte: 0 would mean "no limit"
        budget = max(int(config.budget_fraction * max(free_bytes - model_for(arm).weight_bytes(), 0)), 1)
    else:
        return arm
    fixed = replace(config, budget_bytes=budget, budget_tokens=0, budget_fraction=0.0)
    return replace(arm, plugins={**arm.plugins, Slot.KV_CACHE: fixed})


def kernel_compiles() -> int:
    """Triton kernels of ablate_kernels compiled so far in this process: a run that compiles has
    compilation in its time. 0 when the kernels were never imported (nothing of theirs compiled)."""
    kernels = sys.modules.get("ablate_kernels")
    return kernels.compiled_variants() if kernels is not None else 0


def run_once(arm: Arm, model: LlamaModel, requests: list[Request], engine_cfg: EngineConfig,
             registry: Registry, peaks: Peaks | None, record: bool, track_memory: bool = False) -> ArmRun:
    """Build the arm's engine afresh and serve the requests once. A plugin that breaks the contract
    raises PluginError (the engine's checks). On a GPU the peak memory is the arm's own: the
    allocator's peak from before the build (its KV cache counts) less what was allocated then
    (other arms' models, a probe's leftovers), plus the weights it shares with the resident model."""
    max_seq_len = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    max_seq_len = engine_cfg.max_seq_len or max_seq_len
    if max_seq_len > model.config.max_seq_len:
        raise ValueError(f"the workload needs {max_seq_len} tokens per sequence (workload.prompt_len + "
                         f"workload.output_len, or engine.max_seq_len) but model.max_seq_len is "
                         f"{model.config.max_seq_len}; raise model.max_seq_len or shorten the workload")
    recorders: list[Recorder] = []

    def hooks(kv_cache):
        if not record:
            return ()
        recorders.append(Recorder(kv_cache))
        return recorders

    on_gpu = next(model.parameters()).device.type == "cuda"
    if on_gpu:
        gc.collect()                        # an earlier arm's garbage freed before the mark, not during the arm
        allocated_before = start_cuda_peak(next(model.parameters()).device)   # before the build: its KV counts
    built = build_arm(arm, model, engine_cfg, max_seq_len, registry, hooks)
    try:
        arm_model = built.engine.runner.model        # after the arm's variant (GQA, MLA...): what actually runs
        for rec in recorders:
            rec.cost_model = CostModel(arm_model.config, built.kv_cache.keeps_kv, built.kv_cache.bytes_per_token)
        device = built.engine.device
        tracker = TensorMemoryTracker() if track_memory and device.type != "cuda" else contextlib.nullcontext()
        kv_reserved_before = built.kv_cache.bytes_reserved()
        gc.collect()
        compiled_before, timed_before = kernel_compiles(), PRODUCT_PATHS.timings + tuning.timings()
        start = clock.now(device)
        with tracker:
            seqs = built.engine.run(requests)
        wall = clock.now(device) - start
        row: dict[str, Any] = {"wall_s": wall, "kernel_compiles": kernel_compiles() - compiled_before,
                               "path_timings": PRODUCT_PATHS.timings + tuning.timings() - timed_before}
        if record:
            rec = recorders[0]
            row |= summarise(rec)
            if peaks is not None:
                row |= roofline(rec, peaks)
            requests_df = request_table(rec)
        else:
            row |= {"duration_s": wall, "output_tokens": sum(s.num_output_tokens for s in seqs)}
            row["output_throughput_tok_s"] = row["output_tokens"] / wall
            requests_df = pd.DataFrame()
        row["kv_bytes_per_token"] = built.kv_cache.bytes_per_token
        row["weight_bytes"] = arm_model.weight_bytes()
        row["weight_copy_bytes"] = copy_bytes(arm_model)   # the CPU product paths' packed copies
        row["dtype"] = arm_model.config.dtype           # resolved (model.dtype=auto: bf16 on CUDA, fp32 on the CPU)
        # peak memory: the arm's own CUDA allocator peak (run_once's docstring); on the CPU the tensors
        # we track (weights, their packed copies, KV) and RSS
        if on_gpu:
            row["peak_memory_bytes"] = (cuda_peak_since(device, allocated_before)
                                        + resident_weight_bytes(arm_model, model))
        else:
            row["peak_memory_bytes"] = (row["weight_bytes"] + row["weight_copy_bytes"]
                                        + row.get("kv_reserved_peak_bytes", 0))
        if isinstance(tracker, TensorMemoryTracker):
            # weights and KV held before the run, plus everything the run allocated that was live at once
            row["tracked_peak_bytes"] = tracker.peak_bytes
            row["peak_memory_bytes"] = (row["weight_bytes"] + row["weight_copy_bytes"] + kv_reserved_before
                                        + tracker.peak_bytes)
        row["rss_bytes"] = dev.process_rss_bytes()
        row["attention_backend"] = built.plugins[Slot.ATTENTION].backend
        row |= built.stats()
    finally:
        built.close()
    return ArmRun(row | {"status": "ok", "status_detail": ""}, requests_df, seqs)


def arm_perplexity(arm: Arm, model: LlamaModel, token_ids: list[int], num_context: int, engine_cfg: EngineConfig,
                   registry: Registry) -> float:
    """Perplexity of `token_ids` after the first `num_context` through the arm's runner (its variant,
    KV cache and attention), teacher forced. The context goes in as one step, so the cache is built for
    steps that long (a windowed layer's ring, KVSpec.ring_rows, holds a step's tokens)."""
    engine_cfg = replace(engine_cfg, max_num_batched_tokens=max(engine_cfg.max_num_batched_tokens, num_context))
    built = build_arm(arm, model, engine_cfg, len(token_ids), registry)
    try:
        return runner_perplexity(built.engine.runner, token_ids, num_prefill=num_context)
    finally:
        built.close()
