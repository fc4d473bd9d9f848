"""Training against inference: arithmetic intensity, the device's ridge point, the regime, the MFU ceiling.

A step that does FLOPs F_s and moves bytes B_s on a device of peak FLOP/s F and bandwidth B takes
at least max(B_s / B, F_s / F). Its arithmetic intensity is I = F_s / B_s (FLOP per byte); the
ridge point is F / B. Below the ridge the step is bandwidth-bound and can use at most
I B / F of the FLOP/s, above it compute-bound:

    MFU ceiling = min(1, I B / F)

Per device of a server of N (tensor parallelism splits FLOPs and weight bytes N ways; the KV per
device is ablate/analysis/servers.py's kv_dev), with N_a active parameters of e bytes each:

    decode, b sequences at context c (one new token each):
        FLOPs = b (2 N_a + A(c)) / N          A(c): attention FLOPs of one query over c keys
        bytes = N_a e / N + b c kv_dev        every weight read once a step, each sequence's KV once
        I     = 2 b / e for the weight matmuls alone (2 b N_a / (N_a e)). The KV term does not
                batch: each sequence reads its own KV, whose attention does 2 H / (H_kv e) FLOP a
                byte (MHA: 1 in bf16) whatever b is, so at long contexts I stays low as b grows
    training, b tokens a step (forward + backward):
        FLOPs = 6 N_a b / N                    2 forward, 4 backward (input and weight gradients)
        bytes = 3 N_a e / N                    weights read once forward and about twice backward
        I     = 2 b / e
    Assumptions for training: the weights' matmuls alone. Left out are the traffic of weight
    gradients, optimizer state and saved activations, and the attention FLOPs. b counts tokens: a
    batch of b sequences of s tokens is b s tokens, so reading the usual batch sizes (512, 2048
    sequences) as tokens understates the training intensity by a factor of s.

With e = 2 (bf16) the matmul intensity is b FLOP/byte: batch 1 to a few dozen sits far below an
A100's ridge (312e12 / 2.039e12 = 153 FLOP/byte), 512 and more above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ablate.analysis.servers import ServerCosts

DECODE, TRAINING = "decode", "training"
BANDWIDTH_BOUND, COMPUTE_BOUND = "bandwidth-bound", "compute-bound"
TRAINING_FLOPS_PER_PARAM = 6     # per token: 2 forward + 4 backward
TRAINING_WEIGHT_READS = 3        # per step: forward, backward for inputs, backward for weights


@dataclass(frozen=True)
class StepIntensity:
    """One step of one phase on one device of a server."""

    phase: str                  # decode | training
    batch: int                  # tokens a step (decode: sequences, one token each)
    context: int | None         # decode: keys each sequence attends to; training: None
    flops: float                # per device
    bytes: float                # per device
    weight_matmul_intensity: float   # 2 b / e: the weights' matmuls alone
    ridge: float                # F / B of the device

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def regime(self) -> str:
        return COMPUTE_BOUND if self.intensity >= self.ridge else BANDWIDTH_BOUND

    @property
    def mfu_ceiling(self) -> float:
        return min(1.0, self.intensity / self.ridge)


def decode_step(costs: ServerCosts, batch: int, context: int) -> StepIntensity:
    """b sequences each emit one token at context c: weights read once, each sequence's KV once."""
    return StepIntensity(DECODE, batch, context, costs.decode_flops_per_device(context, batch),
                         costs.decode_bytes_per_device(context, batch),
                         2 * batch / costs.model.element_bytes, costs.server.ridge_flop_per_byte)


def training_step(costs: ServerCosts, tokens: int) -> StepIntensity:
    """Forward + backward over `tokens` tokens: 6 N_a FLOPs a token, the weights read 3 times."""
    m, n = costs.model, costs.num_devices
    flops = TRAINING_FLOPS_PER_PARAM * m.params_active * tokens / n
    moved = TRAINING_WEIGHT_READS * m.active_weight_bytes / n
    return StepIntensity(TRAINING, tokens, None, flops, moved, 2 * tokens / m.element_bytes,
                         costs.server.ridge_flop_per_byte)


def intensity_rows(costs: ServerCosts, decode_batches: list[int], training_batches: list[int],
                   context: int) -> list[dict[str, float | int | str | None]]:
    """The training_vs_inference table's rows for one model on one server."""
    steps = [decode_step(costs, b, context) for b in decode_batches]
    steps += [training_step(costs, b) for b in training_batches]
    device = costs.server.device
    rows = []
    for s in steps:
        seconds = max(s.bytes / device.bandwidth_bytes_s, s.flops / device.flops)
        kv_fits = costs.requests_fit(s.batch, context) if s.phase == DECODE else math.nan
        rows.append({"model": costs.model.label, "num_devices": costs.num_devices, "phase": s.phase,
                     "batch": s.batch, "context": s.context if s.context is not None else math.nan,
                     "flops_per_device": s.flops, "bytes_per_device": s.bytes,
                     "weight_matmul_intensity": s.weight_matmul_intensity, "intensity_flop_per_byte": s.intensity,
                     "ridge_flop_per_byte": s.ridge, "regime": s.regime, "mfu_ceiling": s.mfu_ceiling,
                     "step_ms_lower_bound": 1e3 * seconds, "decode_kv_fits": kv_fits})
    return rows
