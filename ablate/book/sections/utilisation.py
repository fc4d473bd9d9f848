"""7.4: decode leaves a GPU's arithmetic idle, and static batches make short requests wait for long ones.

    decode FLOPs per token     2 N_active + 4 L H d_h c       (matmuls; scores over c keys)
    decode time per token     >= bytes / B,  bytes = W_active + c kv
    MFU at batch 1            <= FLOPs / (bytes / B) / F      (the most of F a bandwidth-bound step uses)
Static batching: a batch of sequences with r_i tokens still to generate holds its slots for max r_i
steps; sum r_i of those slot-steps do work, and a request arriving meanwhile waits max r_i steps.
"""
from __future__ import annotations

from ablate.analysis.costs import DEVICES, model_costs
from ablate.book.claims import DIFFERS, Claim, checked, computed, measured, not_run, number

SECTION = "7.4"
BOOK = "python -m ablate book section=7.4"
CH07 = "python -m ablate +experiment=ch07_costs"
CH08 = "python -m ablate +experiment=ch08_kv_cache"
CH10 = "python -m ablate +experiment=ch10_batching"
TEXTBOOK = "python -m ablate +experiment=ch10_textbook"
CONTEXT = 4096
REMAINING = {"A": 500, "B": 450, "C": 100}      # tokens each request of the book's batch still has to generate


def claims(evidence) -> list[Claim]:
    a100 = DEVICES["a100-80gb"]
    l70 = model_costs({"preset": "llama-2-70b"}, "bf16")
    flops = l70.decode_flops_per_token(CONTEXT)
    seconds = l70.decode_bytes_per_token(CONTEXT) / a100.bandwidth_bytes_s
    ceiling = flops / seconds / a100.flops
    return [
        computed(SECTION, "a100-peak", "An A100's dense BF16 peak", 312e12, "312 TFLOPS", a100.flops,
                 f"{a100.flops / 1e12:g} TFLOP/s", 3, CH07, "the datasheet figure (dense, no sparsity)"),
        computed(SECTION, "decode-flops-70b", "A 70B model does about 2 x 70e9 FLOPs per decoded token",
                 140e9, "140 GFLOPS", 2 * l70.params_active, f"{2 * l70.params_active / 1e9:.1f} GFLOP", 3, CH07,
                 f"LLaMA-2 70B's {l70.params_active / 1e9:.1f}B matmul parameters; attention over {CONTEXT} keys "
                 f"adds {l70.attention_flops_per_token(CONTEXT) / 1e9:.1f} GFLOP; the book's GFLOPS (a rate) is "
                 "a count here"),
        Claim(SECTION, "decode-share-of-peak", "One decoded token uses a tiny share of an A100's arithmetic",
              "0.04% of peak", f"{ceiling:.2%} at most (MFU ceiling, batch 1, {CONTEXT} tokens of context)", DIFFERS,
              f"140e9 / 312e12 = {140e9 / 312e12 * 1e3:.2f} ms is a time, not a share: the share is that time over "
              f"the {seconds * 1e3:.0f} ms the token's {number(l70.decode_bytes_per_token(CONTEXT) / 1e9)} GB take "
              f"at {a100.bandwidth_bytes_s / 1e12:.2f} TB/s", CH07),
        _measured_mfu(evidence, {b: min(1.0, b * ceiling) for b in (1, 8, 32)}),
        _static_batch(),
        _finish_order(evidence),
        _continuous_throughput(evidence),
    ]


def _measured_mfu(evidence, a100_ceilings: dict[int, float]) -> Claim:
    key, claim, book = "decode-mfu-low", "Measured decode MFU is low", "1% - 5%"
    analytic = ", ".join(f"batch {b} {m:.1%}" for b, m in a100_ceilings.items())
    run = evidence.run("ch08_kv_cache")
    row = None if run is None else run.rows("contiguous")
    if row is None or row.empty or row["mfu"].isna().all():
        return not_run(SECTION, key, claim, book, CH08, "decode MFU and MBU on this machine")
    mfu, mbu = float(row["mfu"].median()), float(row["mbu_decode"].median())
    return measured(SECTION, key, claim, book, f"{mfu:.1%} MFU, {mbu:.0%} MBU (batch 1, this machine); "
                    f"A100 ceiling {analytic}", 0.01 <= mfu <= 0.05,
                    f"decode with a KV cache, median over the run's grid; read from {run.label}", CH08)


def _static_batch() -> Claim:
    steps = max(REMAINING.values())
    busy = sum(REMAINING.values())
    idle = 1 - busy / (len(REMAINING) * steps)
    return checked(SECTION, "static-batch-idle", "In a static batch the short request's slot idles and a "
                   "newcomer waits for the longest", "C done early, its slot idle; D waits",
                   f"{idle:.0%} of the batch's slot-steps idle; D waits {steps} steps (static) against "
                   f"{min(REMAINING.values())} (continuous)", idle > 0,
                   "A, B, C with 500, 450, 100 tokens left", BOOK)


def _finish_order(evidence) -> Claim:
    key, claim = "textbook-finish-order", "Continuous batching lets the newcomer finish before the long requests"
    book = "D waits for A and B (static); joins when C leaves (continuous)"
    run = evidence.run("ch10_textbook")
    if run is None:
        return not_run(SECTION, key, claim, book, TEXTBOOK, "the four requests' finish order per scheduler")
    orders = {arm: str(run.arm(arm)["finish_order"]) for arm in ("static", "continuous") if run.arm(arm) is not None}
    holds = orders.get("static", "").endswith("3") and not orders.get("continuous", "3").endswith("3")
    return measured(SECTION, key, claim, book, "; ".join(f"{a}: {o}" for a, o in orders.items()), holds,
                    f"finish order of requests 0-3 (3 arrives last); read from {run.label}", TEXTBOOK)


def _continuous_throughput(evidence) -> Claim:
    key, claim, book = "continuous-throughput", "Continuous batching keeps the device busier than static", "-"
    run = evidence.run("ch10_batching")
    if run is None:
        return not_run(SECTION, key, claim, book, CH10, "throughput per scheduler across request rates")
    rows = run.rows("continuous")
    best = rows.loc[rows["speedup"].idxmax()]
    point = run.point(best)
    return measured(SECTION, key, claim, "(no figure)", f"{best['speedup']:.2f}x static's time "
                    f"[{best['speedup_ci_low']:.2f}, {best['speedup_ci_high']:.2f}] at {point}",
                    best["speedup_ci_low"] > 1, f"the status is {best['status']}; read from {run.label}", CH10)
