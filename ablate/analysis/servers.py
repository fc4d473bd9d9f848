"""A model served by N devices with tensor parallelism (Megatron-style): what each device holds and reads.

A server of N devices, each with memory M, bandwidth B and FLOP/s F, serves a model of weight bytes
W (active W_a), H query heads, H_kv K/V heads and kv KV bytes per token (ablate/analysis/model_costs.py):

    weights per device          W / N                      (every matrix split N ways; the norms and
                                                            embeddings, replicated in practice, are small)
    K/V heads per device        h = ceil(H_kv / N)         (H_kv < N: one head each, so every head is
                                                            held by N / H_kv devices)
    KV replication              N h / H_kv                 (1 when N divides H_kv; MLA's one latent
                                                            row: N, every device holds it)
    KV bytes per token          kv_dev = kv h / H_kv per device, N kv_dev in all
    memory left for KV          M - W / N per device, N (M - W / N) in all (nothing kept for
                                activations, the runtime or fragmentation: an upper bound)
    KV of one request at c      c kv_dev per device, N c kv_dev in all
    requests of c tokens        floor((M - W / N) / (c kv_dev))   (the same on every device)
    decode, b sequences at context c, per device and step:
        bytes                   W_a / N + b c kv_dev
        FLOPs                   b (2 params_active + attention FLOPs at c) / N
        time lower bound        t = max(bytes / B, FLOPs / F)
    It is a lower bound: the two all-reduces per layer that tensor parallelism needs cost nothing
    here. With N = 1 every figure is the single device's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ablate.analysis.devices import ServerSpec
from ablate.analysis.model_costs import ModelCosts


@dataclass(frozen=True)
class ServerCosts:
    """One model on one server, tensor parallel over the server's devices."""

    model: ModelCosts
    server: ServerSpec

    @property
    def num_devices(self) -> int:
        return self.server.num_devices

    @property
    def kv_heads_per_device(self) -> int:
        return math.ceil(self.model.kv_heads / self.num_devices)

    @property
    def kv_replication(self) -> float:
        """How many devices hold each K/V head: 1 when N divides H_kv, N / H_kv when H_kv < N."""
        return self.num_devices * self.kv_heads_per_device / self.model.kv_heads

    @property
    def kv_bytes_per_token_per_device(self) -> int:
        return self.model.kv_bytes_per_token // self.model.kv_heads * self.kv_heads_per_device

    @property
    def kv_bytes_per_token(self) -> int:
        """On the whole server, copies included."""
        return self.num_devices * self.kv_bytes_per_token_per_device

    @property
    def weight_bytes_per_device(self) -> float:
        return self.model.weight_bytes / self.num_devices

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes_per_device < self.server.device.memory_bytes

    @property
    def memory_left_per_device(self) -> float:
        return max(self.server.device.memory_bytes - self.weight_bytes_per_device, 0.0)

    @property
    def memory_left(self) -> float:
        return self.num_devices * self.memory_left_per_device

    @property
    def kv_tokens_that_fit(self) -> float:
        return self.memory_left_per_device // self.kv_bytes_per_token_per_device

    def kv_bytes_per_request_per_device(self, context: int) -> int:
        """One sequence of `context` tokens on one device: context x its bytes per token, but a layer
        with a sliding window keeps its last window tokens only (ModelCosts.kv_bytes_at)."""
        return self.model.kv_bytes_at(context) // self.model.kv_heads * self.kv_heads_per_device

    def kv_bytes_per_request(self, context: int) -> int:
        return self.num_devices * self.kv_bytes_per_request_per_device(context)

    def max_requests(self, context: int) -> float:
        return self.memory_left_per_device // self.kv_bytes_per_request_per_device(context)

    def requests_fit(self, requests: int, context: int) -> bool:
        """`requests` sequences of `context` tokens: their KV fits beside the weights."""
        return self.weights_fit and 0 < requests * self.kv_bytes_per_request_per_device(context) <= \
            self.memory_left_per_device

    def decode_bytes_per_device(self, context: int, batch: int = 1) -> float:
        return self.model.active_weight_bytes / self.num_devices + batch * self.kv_bytes_per_request_per_device(context)

    def decode_flops_per_device(self, context: int, batch: int = 1) -> float:
        return batch * self.model.decode_flops_per_token(context) / self.num_devices

    def decode_seconds(self, context: int, batch: int = 1) -> float:
        """Lower bound on one decode step of `batch` sequences (no communication counted)."""
        device = self.server.device
        return max(self.decode_bytes_per_device(context, batch) / device.bandwidth_bytes_s,
                   self.decode_flops_per_device(context, batch) / device.flops)


def server_row(costs: ServerCosts, contexts: list[int]) -> dict[str, float | int | bool | str]:
    """The `devices` table's row for one model on one server (N = 1: a single device)."""
    m, device = costs.model, costs.server.device
    row = {"num_devices": costs.num_devices, "memory_bytes": costs.server.memory_bytes,
           "weight_bytes": m.weight_bytes, "weight_bytes_per_device": costs.weight_bytes_per_device,
           "weights_fit": costs.weights_fit, "memory_left_for_kv": costs.memory_left,
           "memory_left_for_kv_per_device": costs.memory_left_per_device,
           "kv_heads_per_device": costs.kv_heads_per_device, "kv_replication": costs.kv_replication,
           "kv_bytes_per_token_server": costs.kv_bytes_per_token,
           "kv_bytes_per_token_per_device": costs.kv_bytes_per_token_per_device,
           "kv_tokens_that_fit": costs.kv_tokens_that_fit, "ridge_flop_per_byte": costs.server.ridge_flop_per_byte}
    for c in contexts:
        flops, moved = costs.decode_flops_per_device(c), costs.decode_bytes_per_device(c)
        seconds = costs.decode_seconds(c)
        row |= {f"kv_bytes_per_request_at_{c}": costs.kv_bytes_per_request(c),
                f"kv_bytes_per_request_per_device_at_{c}": costs.kv_bytes_per_request_per_device(c),
                f"max_requests_at_{c}": costs.max_requests(c),
                f"decode_ms_per_token_at_{c}": 1e3 * seconds,
                f"intensity_flop_per_byte_at_{c}": flops / moved,
                f"mfu_ceiling_batch1_at_{c}": flops / seconds / device.flops}
    return row
