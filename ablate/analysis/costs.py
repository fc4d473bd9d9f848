"""Chapter 7's cost calculator: what serving a model costs on a device, from shapes and datasheets alone.

For a model with L layers, H query heads of width d_h, H_kv K/V heads, in a dtype of e bytes, on a
device with memory bandwidth B, dense FLOP/s F and memory M:

    KV bytes per token       kv = 2 L H_kv d_h e              (MLA: L (d_c + d_R) e)
    KV bytes at context c    c kv
    weight bytes             W = params e                      (MoE: every expert is held)
    memory left for KV       M - W                             (nothing kept for activations, the
                                                                runtime or fragmentation: an upper bound)
    KV of N requests at c    N c kv; they fit when N c kv <= M - W; at most floor((M - W) / (c kv))
    decode, batch 1, context c: every active weight and the context's KV are read once per token:
        bytes per token      W_active + c kv                   (W_active: the weights a token uses;
                                                                dense models: all but the embedding table)
        FLOPs per token      2 params_active + 4 L H d_h c     (matmuls; Q K^T and P V over c keys;
                                                                MLA absorbed: 2 L H (2 d_c + d_R) c)
        time lower bound     t = max(bytes / B, FLOPs / F)     (bandwidth-bound at batch 1)
        arithmetic intensity I = FLOPs / bytes  (FLOP/byte; ~2 / e for the matmuls at batch 1)
        MFU ceiling          FLOPs / t / F = min(1, I B / F)   (the most of F decode can use)
    ridge intensity          F / B: below it a step is bandwidth-bound; batching b sequences
                             multiplies the matmul intensity by about b.

Devices: datasheet figures (dense bf16 FLOP/s, no sparsity), and this machine measured by
ablate.measure.hardware.peaks (or given as peak_bandwidth / peak_flops) with its RAM as memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import psutil
import torch

from ablate.model.config import DTYPES, ModelConfig, preset

THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bandwidth_bytes_s: float    # peak memory bandwidth
    flops: float                # peak dense FLOP/s in 16-bit (bf16/fp16) matmuls
    memory_bytes: float         # device memory (10^9-byte GB as datasheets count)
    source: str


DEVICES: dict[str, DeviceSpec] = {
    "a100-80gb": DeviceSpec("A100 80GB SXM", 2.039e12, 312e12, 80e9,
                            "NVIDIA A100 datasheet: HBM2e 2,039 GB/s, BF16 312 TFLOPS dense"),
    "h100-sxm": DeviceSpec("H100 SXM 80GB", 3.35e12, 989e12, 80e9,
                           "NVIDIA H100 datasheet: HBM3 3.35 TB/s, BF16 989 TFLOPS dense (1,979 with sparsity)"),
    "h200": DeviceSpec("H200 SXM 141GB", 4.8e12, 989e12, 141e9,
                       "NVIDIA H200 datasheet: HBM3e 4.8 TB/s, 141 GB, BF16 989 TFLOPS dense"),
}


@dataclass(frozen=True)
class PublishedParams:
    """Parameter counts a ModelConfig cannot express (mixture-of-experts MLPs)."""

    total: float                # every parameter (all experts): what memory holds
    active: float               # parameters one token uses (shared + routed experts): what decode reads
    source: str


PUBLISHED_PARAMS: dict[str, PublishedParams] = {
    "deepseek-v2": PublishedParams(236e9, 21e9, "DeepSeek-V2 paper (arXiv:2405.04434): 236B total, 21B activated "
                                                "per token"),
}


@dataclass
class CostsConfig:
    # model shapes: each a preset name plus ModelConfig fields to change and an optional label
    models: list[dict[str, Any]] = field(default_factory=lambda: [
        {"preset": "llama-2-70b"},
        {"preset": "llama-2-70b", "n_kv_heads": 64, "label": "llama-2-70b-mha (64 KV heads)"},
        {"preset": "gpt-3-175b"}, {"preset": "llama-3-8b"}, {"preset": "deepseek-v2"},
        {"preset": "smollm2-135m"}])
    devices: list[str] = field(default_factory=lambda: [*DEVICES, THIS_MACHINE])   # DEVICES keys, this-machine
    dtype: str = "bf16"                 # weights and KV: bf16 | fp16 | fp32
    context_lens: list[int] = field(default_factory=lambda: [4096, 32768, 131072])
    concurrent_requests: list[int] = field(default_factory=lambda: [1, 16, 64])

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"costs.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        unknown = [d for d in self.devices if d not in DEVICES and d != THIS_MACHINE]
        if unknown:
            raise ValueError(f"costs.devices: unknown {unknown}; choose from {[*DEVICES, THIS_MACHINE]}")
        for entry in self.models:
            if "preset" not in entry:
                raise ValueError(f"costs.models: each entry needs a `preset`, got {entry}")
        for name in ("context_lens", "concurrent_requests"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"costs.{name} must be a non-empty list of positive integers")


@dataclass(frozen=True)
class ModelCosts:
    """A model shape's per-token figures in one dtype."""

    label: str
    cfg: ModelConfig
    element_bytes: int
    params_total: float
    params_active: float            # parameters whose weights a decoded token reads (matmuls)
    kv_bytes_per_token: int

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.element_bytes

    @property
    def active_weight_bytes(self) -> float:
        return self.params_active * self.element_bytes

    def attention_flops_per_token(self, context: int) -> float:
        """Q K^T and P V of one query over `context` keys, every layer and head."""
        cfg = self.cfg
        if cfg.attention_kind == "mla":   # absorbed: scores over d_c + d_R, outputs over d_c
            return 2 * cfg.n_layers * cfg.n_heads * (2 * cfg.kv_latent_dim + cfg.rope_head_dim) * context
        return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context

    def decode_flops_per_token(self, context: int) -> float:
        return 2 * self.params_active + self.attention_flops_per_token(context)

    def decode_bytes_per_token(self, context: int) -> float:
        return self.active_weight_bytes + context * self.kv_bytes_per_token


def model_costs(entry: dict[str, Any], dtype: str) -> ModelCosts:
    fields = {k: v for k, v in entry.items() if k not in ("preset", "label")}
    cfg = preset(entry["preset"], dtype=dtype, **fields)
    label = entry.get("label") or entry["preset"]
    element_bytes = DTYPES[dtype].itemsize
    published = PUBLISHED_PARAMS.get(entry["preset"])
    if published is not None:
        total, active = published.total, published.active
    else:
        total = cfg.num_params()
        # a decoded token reads every matmul weight; of the embedding table only its own row (untied)
        active = total - (0 if cfg.tied_embeddings else cfg.vocab_size * cfg.d_model)
    return ModelCosts(label, cfg, element_bytes, float(total), float(active), cfg.kv_bytes_per_token(element_bytes))


def this_machine(dtype: torch.dtype, bandwidth: float = 0.0, flops: float = 0.0) -> DeviceSpec:
    """The CPU this runs on: bandwidth and matmul FLOP/s measured (cached) or given, RAM as memory."""
    from ablate.measure import hardware
    peaks = hardware.peaks(torch.device("cpu"), dtype, bandwidth, flops)
    return DeviceSpec("this machine (CPU)", peaks.bandwidth_bytes_s, peaks.flops,
                      float(psutil.virtual_memory().total), f"ablate.measure.hardware.peaks ({peaks.source}); RAM from psutil")


def cost_tables(config: CostsConfig, devices: dict[str, DeviceSpec]) -> dict[str, pd.DataFrame]:
    """models: per model; devices: per model x device (context: the first of context_lens for the
    per-token figures, every one for the request limits); requests: per model x device x context x N."""
    models = [model_costs(entry, config.dtype) for entry in config.models]
    model_rows, device_rows, request_rows = [], [], []
    for m in models:
        model_rows.append({"model": m.label, "attention": m.cfg.attention_kind, "layers": m.cfg.n_layers,
                           "heads": m.cfg.n_heads, "kv_heads": m.cfg.kv_cache_widths[0],
                           "params": m.params_total, "params_active": m.params_active,
                           "weight_bytes": m.weight_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
                           **{f"kv_bytes_at_{c}": c * m.kv_bytes_per_token for c in config.context_lens}})
        for key, d in devices.items():
            left = d.memory_bytes - m.weight_bytes
            row = {"model": m.label, "device": key, "memory_bytes": d.memory_bytes, "weight_bytes": m.weight_bytes,
                   "weights_fit": left > 0, "memory_left_for_kv": max(left, 0.0),
                   "kv_tokens_that_fit": max(left, 0.0) // m.kv_bytes_per_token,
                   "ridge_flop_per_byte": d.flops / d.bandwidth_bytes_s}
            for c in config.context_lens:
                flops, moved = m.decode_flops_per_token(c), m.decode_bytes_per_token(c)
                seconds = max(moved / d.bandwidth_bytes_s, flops / d.flops)
                row |= {f"max_requests_at_{c}": max(left, 0.0) // (c * m.kv_bytes_per_token),
                        f"decode_ms_per_token_at_{c}": 1e3 * seconds,
                        f"intensity_flop_per_byte_at_{c}": flops / moved,
                        f"mfu_ceiling_batch1_at_{c}": flops / seconds / d.flops}
                for n in config.concurrent_requests:
                    kv = n * c * m.kv_bytes_per_token
                    request_rows.append({"model": m.label, "device": key, "context": c, "requests": n,
                                         "kv_bytes": kv, "memory_left_for_kv": max(left, 0.0),
                                         "fits": 0 < kv <= left})
            device_rows.append(row)
    return {"models": pd.DataFrame(model_rows), "devices": pd.DataFrame(device_rows),
            "requests": pd.DataFrame(request_rows)}


def printed_table(tables: dict[str, pd.DataFrame], config: CostsConfig) -> pd.DataFrame:
    """One row per model x device: the figures a reader wants first, in readable units."""
    c0 = config.context_lens[0]
    dev = tables["devices"].merge(tables["models"][["model", "kv_bytes_per_token"]], on="model")
    out = pd.DataFrame({
        "model": dev["model"], "device": dev["device"],
        "weights GB": (dev["weight_bytes"] / 1e9).round(1),
        "KV/token KiB": (dev["kv_bytes_per_token"] / 2**10).round(1),
        "KV GB left": (dev["memory_left_for_kv"] / 1e9).round(1),
        **{f"max reqs @{c}": dev[f"max_requests_at_{c}"].astype(int) for c in config.context_lens},
        f"ms/token @{c0}": dev[f"decode_ms_per_token_at_{c0}"].round(3),
        f"FLOP/B @{c0}": dev[f"intensity_flop_per_byte_at_{c0}"].round(2),
        f"MFU ceiling @{c0}": dev[f"mfu_ceiling_batch1_at_{c0}"].map(lambda x: f"{x:.2%}"),
    })
    return out


def resolve_devices(config: CostsConfig, bandwidth: float = 0.0, flops: float = 0.0) -> dict[str, DeviceSpec]:
    out = {}
    for key in config.devices:
        out[key] = DEVICES[key] if key != THIS_MACHINE else this_machine(DTYPES[config.dtype], bandwidth, flops)
    return out
