"""7.5: a small model drafts, the large one verifies k drafts in one pass.

    decode time per token (bandwidth-bound)   ~ W_active / B: a 7B model is ~W_70B / W_7B times faster
    tokens per target pass                    E = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
                                              (a drafts accepted on average, plus the target's own token)
    speedup                                   E / (k c + r(k))     (c: a draft pass's cost in target passes,
                                              r(k): the verify pass's cost in one-token steps; Leviathan et al. 2023)
    verify FLOPs over k + 1 tokens after c    2 N (k + 1) + 4 L H d_h sum_j (c + j): linear in k while c >> k
"""
from __future__ import annotations

from ablate.analysis.analytic import CostModel
from ablate.analysis.costs import model_costs
from ablate.book.claims import DIFFERS, Claim, checked, computed, in_bytes, measured, not_run
from ablate.model.presets import preset

SECTION = "7.5"
BOOK = "python -m ablate book section=7.5"
CH07 = "python -m ablate +experiment=ch07_costs"
CH11 = "python -m ablate +experiment=ch11_speculative"
VERIFY = "python benchmarks/verify_cost.py"
DRAFT_COST = 0.1            # a 7B draft pass against a 70B target pass: their weight bytes' ratio, rounded


def claims(evidence) -> list[Claim]:
    l70, l7 = model_costs({"preset": "llama-2-70b"}, "fp16"), model_costs({"preset": "llama-2-7b"}, "fp16")
    speed = l70.active_weight_bytes / l7.active_weight_bytes
    return [
        in_bytes(SECTION, "weights-read-per-token", "A 70B model reads about 140 GB of weights per token", 140, "GB",
                 l70.active_weight_bytes, 3, CH07, "every matmul weight once (the embedding table: one row)"),
        computed(SECTION, "7b-10x-faster", "A 7B model decodes about 10x faster (bandwidth-bound)", 10, "10x",
                 speed, f"{speed:.1f}x", 2, CH07, "the ratio of the weight bytes each token reads"),
        _verify_linear(),
        _verify_flat(evidence),
        _three_accepted(),
        _measured_speedup(evidence),
    ]


def _verify_linear() -> Claim:
    """FLOPs of a verify pass grow by the same amount per extra draft: O(k)."""
    model = CostModel(preset("llama-2-70b", dtype="fp16"), keeps_kv=True)
    context = 4096
    flops = [model.step([k + 1], [context + k + 1], k + 1).flops for k in range(17)]
    steps = [b - a for a, b in zip(flops, flops[1:])]
    spread = max(steps) / min(steps) - 1
    return checked(SECTION, "verify-linear", "Verifying k drafts costs O(k) FLOPs, not O(k^2)", "O(k)",
                   f"each extra draft adds {steps[0] / 1e9:.0f} GFLOP (+-{spread:.2%} from k = 1 to 16)", spread < 0.01,
                   f"LLaMA-2 70B after {context} tokens of context: the drafts' own scores are the k^2 term", BOOK)


def _verify_flat(evidence) -> Claim:
    key, claim, book = "verify-about-one-step", "Verifying k drafts costs about one decode step", "~1 step"
    frame = evidence.verify
    if frame is None:
        return not_run(SECTION, key, claim, book, VERIFY, "a verify pass of k + 1 tokens against a one-token step")
    from ablate.measure.verify_cost import knee
    flat = knee(frame)
    by_k = frame.set_index("k")
    shown = ", ".join(f"k={k}: {by_k.loc[k, 'ratio']:.2f}x" for k in by_k.index if k in (1, 4, 8, 16))
    return measured(SECTION, key, claim, book, f"{shown}; within 1.2x up to k = {flat}", flat >= 3,
                    f"{evidence.verify_label}; the roofline predicts {by_k['predicted_ratio'].iloc[-1]:.2f}x at "
                    f"k = {by_k.index[-1]}", VERIFY)


def _three_accepted() -> Claim:
    k, accepted = 4, 3.0
    tokens = accepted + 1                       # the target's own token comes with every pass
    speedup = tokens / (k * DRAFT_COST + 1)
    return Claim(SECTION, "three-accepted-three-x", "Accepting 3 drafts on average makes decoding 3x faster", "3x",
                 f"{tokens:.0f} tokens per target pass; {speedup:.2f}x with k = {k} drafts at {DRAFT_COST} of a "
                 "target pass each", DIFFERS,
                 "each pass also yields the target's own token (+1), and drafting is not free (k c in the "
                 "denominator): tokens per pass is not the speedup", BOOK)


def _measured_speedup(evidence) -> Claim:
    key, claim, book = "speculative-here", "Speculative decoding's speedup, measured", "-"
    run = evidence.run("ch11_speculative")
    column = "tokens_per_emission"          # tokens a request gets per target pass (1 autoregressive)
    if run is None or column not in run.summary:
        return not_run(SECTION, key, claim, book, CH11, "speedup and tokens per target pass for every drafter and k")
    rows = run.summary[run.summary["arm"] != (run.config.get("experiment") or {}).get("baseline", "autoregressive")]
    best = rows.loc[rows["speedup"].idxmax()]
    point = f" ({best['prompt_kind']} prompts)" if "prompt_kind" in best else ""
    return measured(SECTION, key, claim, "(the book gives no figure)",
                    f"best: {best['arm']}{point} {best['speedup']:.2f}x [{best['speedup_ci_low']:.2f}, "
                    f"{best['speedup_ci_high']:.2f}] at {best[column]:.2f} tokens per emission",
                    bool(best["speedup_ci_low"] > 1 and best["status"] == "ok"),
                    f"status {best['status']}; the speedup stays below tokens per pass; read from {run.label}", CH11)
