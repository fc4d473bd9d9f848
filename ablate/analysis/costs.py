"""The cost calculator: what serving a model costs on a device or server, from shapes and datasheets alone.

For a model with L layers, H query heads of width d_h, H_kv K/V heads, in a dtype of e bytes, on a
device with memory bandwidth B, dense FLOP/s F and memory M (the model side:
ablate/analysis/model_costs.py; devices and `<N>x<device>` servers: ablate/analysis/devices.py):

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

A server of N devices splits weights and K/V heads N ways (tensor parallelism; K/V replicated when
H_kv < N): ablate/analysis/servers.py, whose formulas reduce to the above for N = 1. Decode at
batch sizes of serving against training steps (arithmetic intensity, regime, MFU ceiling):
ablate/analysis/intensity.py.

Tables (cost_tables): models (per model), devices (per model x device or server), requests (per
model x device x context x concurrent requests), training_vs_inference (per model x device x phase
x batch, decode at the first of context_lens).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ablate.analysis.devices import DEVICES, SERVER_SYNTAX, THIS_MACHINE, DeviceSpec, ServerSpec, parse_server
from ablate.analysis.intensity import TRAINING, intensity_rows
from ablate.analysis.model_costs import PUBLISHED_PARAMS, ModelCosts, PublishedParams, model_costs
from ablate.analysis.servers import ServerCosts, server_row
from ablate.model.config import DTYPES

__all__ = ["DEVICES", "PUBLISHED_PARAMS", "SERVERS", "THIS_MACHINE", "CostsConfig", "DeviceSpec", "ModelCosts",
           "PublishedParams", "ServerSpec", "cost_tables", "model_costs", "printed_intensity_table", "printed_table"]

SERVERS = ["4xa100-80gb", "8xh100-sxm", "8xh200"]      # the default multi-device servers


@dataclass
class CostsConfig:
    # model shapes: each a preset name plus ModelConfig fields to change, an optional label and an
    # optional weights_of (a preset whose unchanged shape gives the parameter counts: model_costs)
    models: list[dict[str, Any]] = field(default_factory=lambda: [
        {"preset": "llama-2-70b"},
        {"preset": "llama-2-70b", "n_kv_heads": 64, "label": "llama-2-70b-mha (64 KV heads)"},
        {"preset": "llama-2-70b", "n_kv_heads": 64, "weights_of": "llama-2-70b", "label": "llama-2-70b-book"},
        {"preset": "llama-2-7b"}, {"preset": "gpt-3-175b"}, {"preset": "llama-3-8b"}, {"preset": "deepseek-v2"},
        {"preset": "smollm2-135m"}])
    # DEVICES keys, <N>x<DEVICES key> servers (tensor parallel over N), this-machine
    devices: list[str] = field(default_factory=lambda: [*DEVICES, *SERVERS, THIS_MACHINE])
    dtype: str = "bf16"                 # weights and KV: bf16 | fp16 | fp32
    context_lens: list[int] = field(default_factory=lambda: [4096, 32768, 131072])
    concurrent_requests: list[int] = field(default_factory=lambda: [1, 16, 64])
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 32])        # sequences a decode step
    training_batches: list[int] = field(default_factory=lambda: [512, 2048])    # tokens a training step

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"costs.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        unknown = []
        for name in self.devices:
            try:
                parse_server(name)
            except ValueError:
                unknown.append(name)
        if unknown:
            raise ValueError(f"costs.devices: unknown {unknown}; write {SERVER_SYNTAX}, with devices "
                             f"{sorted(DEVICES)} (or {THIS_MACHINE!r} alone), e.g. {[*DEVICES][0]}, {SERVERS[0]}")
        for entry in self.models:
            if "preset" not in entry:
                raise ValueError(f"costs.models: each entry needs a `preset`, got {entry}")
        for name in ("context_lens", "concurrent_requests", "decode_batches", "training_batches"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"costs.{name} must be a non-empty list of positive integers, got {values}")


def _as_server(spec: DeviceSpec | ServerSpec) -> ServerSpec:
    return spec if isinstance(spec, ServerSpec) else ServerSpec(spec, 1)


def cost_tables(config: CostsConfig, devices: Mapping[str, DeviceSpec | ServerSpec]) -> dict[str, pd.DataFrame]:
    """models: per model; devices: per model x device or server (context: the first of context_lens
    for the per-token figures, every one for the request limits); requests: per model x device x
    context x N; training_vs_inference: per model x device x phase x batch (decode at context_lens[0])."""
    models = [model_costs(entry, config.dtype) for entry in config.models]
    servers = {key: _as_server(spec) for key, spec in devices.items()}
    model_rows, device_rows, request_rows, intensity = [], [], [], []
    for m in models:
        model_rows.append({"model": m.label, "attention": m.cfg.attention_kind, "layers": m.cfg.n_layers,
                           "heads": m.cfg.n_heads, "kv_heads": m.kv_heads,
                           "params": m.params_total, "params_active": m.params_active,
                           "weight_bytes": m.weight_bytes, "active_weight_bytes": m.active_weight_bytes,
                           "kv_bytes_per_token": m.kv_bytes_per_token,
                           **{f"kv_bytes_at_{c}": m.kv_bytes_at(c) for c in config.context_lens}})
        for key, server in servers.items():
            costs = ServerCosts(m, server)
            device_rows.append({"model": m.label, "device": key, **server_row(costs, config.context_lens)})
            for c in config.context_lens:
                for n in config.concurrent_requests:
                    request_rows.append({"model": m.label, "device": key, "context": c, "requests": n,
                                         "kv_bytes": n * costs.kv_bytes_per_request(c),
                                         "memory_left_for_kv": costs.memory_left,
                                         "fits": costs.requests_fit(n, c)})
            intensity += [{"device": key, **row} for row in intensity_rows(
                costs, config.decode_batches, config.training_batches, config.context_lens[0])]
    return {"models": pd.DataFrame(model_rows), "devices": pd.DataFrame(device_rows),
            "requests": pd.DataFrame(request_rows), "training_vs_inference": pd.DataFrame(intensity)}


def printed_table(tables: dict[str, pd.DataFrame], config: CostsConfig) -> pd.DataFrame:
    """One row per model x device: the figures a reader wants first, in readable units."""
    c0 = config.context_lens[0]
    dev = tables["devices"]
    return pd.DataFrame({
        "model": dev["model"], "device": dev["device"],
        "weights GB": (dev["weight_bytes"] / 1e9).round(1),
        "GB/device": (dev["weight_bytes_per_device"] / 1e9).round(1),
        "KV/token KiB": (dev["kv_bytes_per_token_server"] / 2**10).round(1),   # copies included
        "KV copies": dev["kv_replication"].round(2),
        "KV GB left": (dev["memory_left_for_kv"] / 1e9).round(1),
        **{f"max reqs @{c}": dev[f"max_requests_at_{c}"].astype(int) for c in config.context_lens},
        f"ms/token @{c0}": dev[f"decode_ms_per_token_at_{c0}"].round(3),
        f"FLOP/B @{c0}": dev[f"intensity_flop_per_byte_at_{c0}"].round(2),
        f"MFU ceiling @{c0}": dev[f"mfu_ceiling_batch1_at_{c0}"].map(lambda x: f"{x:.2%}"),
    })


def printed_intensity_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per model x device; a column per phase and batch: 'intensity (MFU ceiling)'."""
    rows = tables["training_vs_inference"]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows.itertuples():
        row = out.setdefault((r.model, r.device), {"model": r.model, "device": r.device,
                                                   "ridge FLOP/B": round(r.ridge_flop_per_byte, 1)})
        phase = "train" if r.phase == TRAINING else "decode"
        mark = "" if r.regime == "compute-bound" else " bw"
        value = r.intensity_flop_per_byte
        row[f"{phase} b={r.batch}"] = f"{value:.3g}{mark} ({r.mfu_ceiling:.1%})" if value < 100 else \
            f"{value:.0f}{mark} ({r.mfu_ceiling:.0%})"
    return pd.DataFrame(list(out.values()))
