"""The n x n attention scores in memory: one head's, one layer's, one forward pass's, and the bytes
attention moves, for a run's model and for the book's setting (64 heads, fp16).

With n tokens, H query heads, L layers and s bytes per score (fp16: 2; fp32: 4):

    one head            n^2 s        n = 32768, fp16: 32768^2 x 2 = 2,147,483,648 B = 2 GiB exactly (2.15 GB)
    one layer           H n^2 s      64 heads: 128 GiB (137 GB); materialised attention writes these
                                     scores (and the softmax's, as large) to memory and reads them back
    one forward pass    L H n^2 s    were every layer's scores kept (attention holds one layer's at a time)

The book counts fp16 scores; ablate's naive attention keeps fp32 ones whatever the model's dtype, so
a run's model is read with s = 4 and both per-head readings are shown. Beside them, per layer, what
attention moves (ablate.analysis.attention_io): materialised (naive: 8 passes over fp32 scores and the
mask, plus Q, K, V, O) against tiled (FlashAttention-2's forward with the tile height the run's
flash attention uses), and naive's peak: two fp32 score matrices of a layer, 8 H n^2.

The book's setting is Llama-2-70B's shape (64 query heads of 128, 8 K/V heads, 80 layers) in fp16.
A row is `measured` where the run's summary has the naive arm's peak memory at that length (weights,
activations and scores together: the tracked tensors on a CPU, the allocator's peak on a GPU),
`analytic` otherwise.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import pandas as pd
import torch

from ablate.analysis.attention_io import (AttentionShape, materialised_bytes, sdpa_flash_block_m, tiled_bytes,
                                          triton_flash_block_m)
from ablate.model.config import ModelConfig
from ablate.model.presets import preset

BOOK_PRESET = "llama-2-70b"               # 64 query heads, as the book's example
BOOK_ELEMENT_BYTES = 2                    # fp16: Q, K, V, O and the scores
EXTRA_SEQ_LENS = (16384, 32768, 131072)   # the book's 32k, one below, one above
NAIVE_SCORE_BYTES = 4                     # ablate's naive attention keeps fp32 scores
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
UNITS = ((2**40, 10**12, "TiB", "TB"), (2**30, 10**9, "GiB", "GB"), (2**20, 10**6, "MiB", "MB"),
         (2**10, 10**3, "KiB", "KB"))


def score_bytes(seq_len: int, n_heads: int = 1, n_layers: int = 1, score_element_bytes: int = 2) -> int:
    """L H n^2 s: the scores of n queries against n keys, per head, layer and score element."""
    for name, value in (("seq_len", seq_len), ("n_heads", n_heads), ("n_layers", n_layers),
                        ("score_element_bytes", score_element_bytes)):
        if value <= 0:
            raise ValueError(f"score_bytes: {name} must be a positive integer, got {value}")
    return n_layers * n_heads * seq_len**2 * score_element_bytes


def score_memory_frame(cfg: ModelConfig, seq_lens: Sequence[int], element_bytes: int, score_element_bytes: int,
                       device_type: str = "cuda") -> pd.DataFrame:
    """One row per length, in bytes: one head's scores in fp16 and fp32, one layer's and one forward
    pass's in score_element_bytes, naive's peak, and what materialised and tiled attention move per
    layer (tiled: the Triton kernel's tile on CUDA, SDPA's CPU flash tile elsewhere)."""
    rows = []
    for n in seq_lens:
        shape = AttentionShape(n, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, element_bytes)
        block_m = (triton_flash_block_m(cfg.head_dim, element_bytes) if device_type == "cuda"
                   else sdpa_flash_block_m(n, device_type))
        rows.append({"seq_len": n, "n_heads": cfg.n_heads, "n_layers": cfg.n_layers,
                     "head_fp16_bytes": score_bytes(n, score_element_bytes=2),
                     "head_fp32_bytes": score_bytes(n, score_element_bytes=4),
                     "layer_bytes": score_bytes(n, cfg.n_heads, 1, score_element_bytes),
                     "forward_bytes": score_bytes(n, cfg.n_heads, cfg.n_layers, score_element_bytes),
                     "naive_peak_bytes": 2 * score_bytes(n, cfg.n_heads, 1, NAIVE_SCORE_BYTES),
                     "materialised_bytes": materialised_bytes(shape), "tiled_bytes": tiled_bytes(shape, block_m),
                     "block_m": block_m})
    return pd.DataFrame(rows)


def book_frame(seq_lens: Sequence[int] = EXTRA_SEQ_LENS) -> pd.DataFrame:
    """The book's setting: 64 heads (Llama-2-70B's shape), fp16 everywhere, on a GPU."""
    return score_memory_frame(preset(BOOK_PRESET), list(seq_lens), BOOK_ELEMENT_BYTES, BOOK_ELEMENT_BYTES, "cuda")


def both_units(num_bytes: float) -> str:
    """'2 GiB = 2.147 GB': binary and decimal readings of a byte count (the book's GB may be either)."""
    if num_bytes is None or (isinstance(num_bytes, float) and math.isnan(num_bytes)):
        return "-"
    for binary, decimal, binary_name, decimal_name in UNITS:
        if num_bytes >= binary:
            return f"{num_bytes / binary:,.4g} {binary_name} = {num_bytes / decimal:,.4g} {decimal_name}"
    return f"{num_bytes:,.0f} B"


def run_model(config: dict[str, Any]) -> ModelConfig:
    """The run's ModelConfig from its resolved config (config.json's `model`)."""
    model = config.get("model")
    if not isinstance(model, dict) or not model:
        raise ValueError("score memory: the config has no `model` section (a dict of ModelConfig fields, as "
                         "config.json stores it)")
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in model.items() if k in known})


def run_seq_lens(config: dict[str, Any]) -> list[int]:
    """The run's prompt lengths: experiment.grid.prompt_len, else workload.prompt_len."""
    grid = (config.get("experiment") or {}).get("grid") or {}
    lens = grid.get("prompt_len") or [(config.get("workload") or {}).get("prompt_len")]
    if not all(isinstance(n, int) and n > 0 for n in lens):
        raise ValueError(f"score memory: prompt lengths must be positive integers, got {lens} (from "
                         "experiment.grid.prompt_len or workload.prompt_len)")
    return [int(n) for n in lens]


def naive_arms(config: dict[str, Any]) -> set[str]:
    """The arms that run attention=naive: named so, or inheriting a root attention that is naive."""
    root = (config.get("attention") or {}).get("name", "naive")
    arms = set()
    for name, spec in ((config.get("experiment") or {}).get("arms") or {}).items():
        attention = (spec or {}).get("attention", root)
        if (attention.get("name", root) if isinstance(attention, dict) else attention) == "naive":
            arms.add(name)
    return arms


def measured_naive_peaks(config: dict[str, Any], summary: pd.DataFrame | None) -> dict[int, float]:
    """prompt length -> the naive arm's measured peak memory (the largest where the grid has more
    axes); lengths it did not measure (absent, failed) are left out."""
    if summary is None or summary.empty or "peak_memory_bytes" not in summary or "arm" not in summary:
        return {}
    rows = summary[summary["arm"].isin(naive_arms(config)) & summary["peak_memory_bytes"].notna()]
    if "status" in rows:
        rows = rows[rows["status"].fillna("ok").isin(("ok", "degraded"))]
    if "prompt_len" not in rows:        # no grid over it: every row is at workload.prompt_len
        rows = rows.assign(prompt_len=run_seq_lens(config)[0])
    return {int(n): float(peak) for n, peak in rows.groupby("prompt_len")["peak_memory_bytes"].max().items()}


def _device_type(config: dict[str, Any]) -> str:
    device = str(config.get("device", "cpu"))
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else device.split(":")[0]


def score_memory_table(config: dict[str, Any], summary: pd.DataFrame | None) -> pd.DataFrame:
    """The report's table: the run's model at its prompt lengths and EXTRA_SEQ_LENS, then the book's
    setting; byte counts in both units, `source` measured or analytic with why."""
    cfg, device = run_model(config), _device_type(config)
    grid = run_seq_lens(config)
    lens = sorted(set(grid) | set(EXTRA_SEQ_LENS))
    element = ELEMENT_BYTES.get(cfg.dtype, 2 if device == "cuda" else 4)    # auto: bf16 on CUDA, fp32 else
    peaks = measured_naive_peaks(config, summary)
    run = score_memory_frame(cfg, lens, element, NAIVE_SCORE_BYTES, device).assign(
        setting=f"{cfg.name}: {cfg.n_heads} heads, {cfg.n_layers} layers, fp32 scores (this run)")
    run["measured_peak_bytes"] = run["seq_len"].map(peaks)
    run["source"] = ["measured" if n in peaks else "analytic" for n in run["seq_len"]]
    run["note"] = [_why_analytic(n, grid, peaks, device, row) for n, (_, row) in zip(run["seq_len"], run.iterrows())]
    book = book_frame(lens).assign(setting=f"book: 64 heads, fp16 ({BOOK_PRESET} shape, 80 layers)",
                                   measured_peak_bytes=math.nan, source="analytic",
                                   note="the book's setting: a 70B-shape model is not run here")
    frame = pd.concat([run, book], ignore_index=True)
    return pd.DataFrame({
        "setting": frame["setting"], "n": frame["seq_len"],
        "1 head fp16": frame["head_fp16_bytes"].map(both_units),
        "1 head fp32": frame["head_fp32_bytes"].map(both_units),
        "1 layer (all heads)": frame["layer_bytes"].map(both_units),
        "1 forward (all layers)": frame["forward_bytes"].map(both_units),
        "moved/layer materialised": frame["materialised_bytes"].map(both_units),
        "moved/layer tiled": frame["tiled_bytes"].map(both_units),
        "naive peak: 2 fp32 scores": frame["naive_peak_bytes"].map(both_units),
        "naive peak measured": frame["measured_peak_bytes"].map(both_units),
        "source": frame["source"], "note": frame["note"]})


def _why_analytic(n: int, grid: list[int], peaks: dict[int, float], device: str, row: pd.Series) -> str:
    if n in peaks:
        return "measured peak = weights + activations + scores, over the run's rounds"
    if n in grid:
        return "in the grid, but the naive arm has no peak memory there (absent, failed or not tracked)"
    if device == "cpu" and n >= 32768:
        return (f"never measured on a CPU: naive would hold {both_units(row['naive_peak_bytes'])} of scores "
                "alone, at O(n^2) time")
    return "beyond the run's grid"
