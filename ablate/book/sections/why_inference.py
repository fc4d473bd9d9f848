"""7.1: inference pays per request, with a latency bound; decode is bandwidth-bound, training is not.

    weight bytes               W = params e
    bytes a decoded token reads  W_active + c kv            (every weight and the context's K/V, once)
The training-vs-decode contrast (arithmetic intensity against the ridge F / B, the MFU ceiling) is
ablate.analysis.intensity's; measured here, a decode step's MBU against its MFU.
"""
from __future__ import annotations

from ablate.analysis.devices import server_spec
from ablate.analysis.intensity import BANDWIDTH_BOUND, COMPUTE_BOUND, decode_step, training_step
from ablate.analysis.model_costs import model_costs
from ablate.analysis.servers import ServerCosts
from ablate.book.claims import Claim, checked, in_bytes, measured, not_run

SECTION = "7.1"
CH07 = "python -m ablate +experiment=ch07_costs"
CH08 = "python -m ablate +experiment=ch08_kv_cache"
CH10 = "python -m ablate +experiment=ch10_batching"
TTFT_BOUND_MS = 1000.0      # the book's bound: the first token within a second or so
DECODE_BATCHES, TRAINING_BATCHES, CONTEXT = (1, 8, 32), (512, 2048), 4096


def claims(evidence) -> list[Claim]:
    l70 = model_costs({"preset": "llama-2-70b"}, "fp16")
    return [
        _ttft(evidence),
        in_bytes(SECTION, "weights-70b", "A 70B model's weights in FP16 take about 140 GB", 140, "GB",
                 l70.weight_bytes, 3, CH07, f"LLaMA-2 70B: {l70.params_total / 1e9:.2f}B parameters x 2 bytes"),
        *_training_vs_decode(),
        _bandwidth_bound_here(evidence),
    ]


def _training_vs_decode() -> list[Claim]:
    """LLaMA-2 70B in bf16 on 4 A100s: decode batches below the ridge, training batches above it."""
    server = ServerCosts(model_costs({"preset": "llama-2-70b"}, "bf16"), server_spec("4xa100-80gb"))
    decode = [decode_step(server, b, CONTEXT) for b in DECODE_BATCHES]
    training = [training_step(server, t) for t in TRAINING_BATCHES]
    ridge = decode[0].ridge
    regimes = all(s.regime == BANDWIDTH_BOUND for s in decode) and all(s.regime == COMPUTE_BOUND for s in training)

    def shown(steps) -> str:
        return ", ".join(f"{s.batch}: {s.intensity:.0f}" for s in steps)
    return [
        checked(SECTION, "decode-vs-training-regime", "Training batches are compute-bound, decode batches "
                "bandwidth-bound", "training 512, 2048: compute; decode 1 to dozens: memory",
                f"FLOP/byte at batch {shown(decode)} (decode) and {shown(training)} (training) against a ridge of "
                f"{ridge:.0f}", regimes, f"LLaMA-2 70B, bf16, 4 A100s, decode at {CONTEXT} tokens; training "
                "reads the weights 3 times a step (ablate.analysis.intensity)", CH07),
        checked(SECTION, "decode-vs-training-mfu", "Training keeps the arithmetic busy, decode leaves it idle",
                "high against low utilisation", "MFU ceiling " + ", ".join(
                    f"{s.phase} {s.batch}: {s.mfu_ceiling:.1%}" for s in (*decode, *training)),
                decode[-1].mfu_ceiling < 0.5 <= training[0].mfu_ceiling, "ceilings from the roofline, not "
                "measurements", CH07),
    ]


def _ttft(evidence) -> Claim:
    key, claim, book = "ttft-within-a-second", "Users need the first token within about a second", "TTFT < ~1 s"
    run = evidence.run("ch10_batching")
    if run is None:
        return not_run(SECTION, key, claim, book, CH10, "TTFT per scheduler and request rate, with a TTFT SLO")
    rows = run.rows("continuous")
    if rows.empty:
        return not_run(SECTION, key, claim, book, CH10, "the continuous arm (the stored run has none)")
    parts, held = [], True
    for _, row in rows.iterrows():
        point = run.point(row)
        attained = f", {row['ttft_slo_attained']:.0%} within the SLO" if "ttft_slo_attained" in row else ""
        parts.append(f"{point}: p50 {row['ttft_p50_ms']:.0f} ms{attained}")
        held &= row["ttft_p50_ms"] <= TTFT_BOUND_MS
    slo = (run.config.get("experiment") or {}).get("ttft_slo_ms")
    return measured(SECTION, key, claim, book, "; ".join(parts), bool(held),
                    f"continuous batching, TTFT SLO {slo} ms; read from {run.label}", CH10)


def _bandwidth_bound_here(evidence) -> Claim:
    key, claim = "decode-bandwidth-bound", "Decode reads every weight and the K/V for each token: bandwidth-bound"
    book = "memory-bound, little compute"
    run = evidence.run("ch08_kv_cache")
    rows = None if run is None else run.rows("contiguous")
    if rows is None or rows.empty or rows["mbu_decode"].isna().all():
        return not_run(SECTION, key, claim, book, CH08, "decode MBU (bandwidth used) against MFU on this machine")
    mbu, mfu = float(rows["mbu_decode"].median()), float(rows["mfu"].median())
    return measured(SECTION, key, claim, book, f"MBU {mbu:.0%} against MFU {mfu:.1%} (batch 1)", mbu > mfu,
                    f"a decode step uses a larger share of the bandwidth than of the arithmetic; read from {run.label}",
                    CH08)
