"""7.7: K/V bytes grow with the number of K/V heads; MQA, GQA and MLA store fewer.

    KV bytes per token = 2 L H_kv d_h e            (MLA: L (d_c + d_R) e: a latent and a rotary key)
    MHA -> GQA with G groups: H / G times fewer;   MHA -> MQA: H times fewer
    one K/V head's worth per layer = 2 d_h numbers, so MLA holds (d_c + d_R) / (2 d_h) heads' worth
"""
from __future__ import annotations

from ablate.analysis.costs import model_costs
from ablate.book.claims import DIFFERS, Claim, checked, computed, in_bytes, measured, not_run, number

SECTION = "7.7"
BOOK = "python -m ablate book section=7.7"
CH07 = "python -m ablate +experiment=ch07_costs"
CH13 = "python -m ablate +experiment=ch13_gqa_mla"
SHIPPED = "gqa3"            # ch13's arm of SmolLM2 as shipped (3 K/V heads)
LOST = 1.05                 # a perplexity ratio above this lost quality (the quality guard's default limit)


def claims(evidence) -> list[Claim]:
    gpt3 = model_costs({"preset": "gpt-3-175b"}, "fp16")
    l70_book = model_costs({"preset": "llama-2-70b", "n_kv_heads": 64}, "fp16")
    l70 = model_costs({"preset": "llama-2-70b"}, "fp16")
    out = [
        computed(SECTION, "kv-per-token-gpt3", "GPT-3 175B (96 layers, 96 K/V heads of 128) stores this many KV "
                 "bytes per token in fp16", 4_718_592, "4,718,592 bytes", gpt3.kv_bytes_per_token,
                 f"{gpt3.kv_bytes_per_token:,} bytes", 7, CH07),
        in_bytes(SECTION, "kv-per-token-gpt3-mb", "... which is about 4.5 MB", 4.5, "MB", gpt3.kv_bytes_per_token, 2,
                 BOOK),
        checked(SECTION, "gpt3-above-llama70b", "GPT-3's KV per token exceeds LLaMA-2 70B's",
                "larger than 2.5 MB", f"{gpt3.kv_bytes_per_token / l70_book.kv_bytes_per_token:.1f}x the book's "
                f"64-head LLaMA-2 70B, {gpt3.kv_bytes_per_token / l70.kv_bytes_per_token:.1f}x the real 8-head one",
                gpt3.kv_bytes_per_token > l70_book.kv_bytes_per_token, "", CH07),
        _fraction("mqa-one-over-h", "MQA keeps one K/V pair for all H heads: 1/H of MHA's KV", gpt3, 1),
        _mla_heads(),
        _gqa_savings(),
        _gqa_adopters(),
        _capacity(evidence),
        *_quality(evidence),
    ]
    return out


def _fraction(key: str, claim: str, mha, kv_heads: int) -> Claim:
    shared = model_costs({"preset": mha.cfg.name, "n_kv_heads": kv_heads}, "fp16")
    ratio = shared.kv_bytes_per_token / mha.kv_bytes_per_token
    return computed(SECTION, key, claim, 1 / mha.cfg.n_heads, f"1/H (GPT-3: 1/{mha.cfg.n_heads})", ratio,
                    f"1/{mha.kv_bytes_per_token / shared.kv_bytes_per_token:g}", 6, CH07)


def _mla_heads() -> Claim:
    v2 = model_costs({"preset": "deepseek-v2"}, "fp16").cfg
    per_layer = v2.kv_latent_dim + v2.rope_head_dim        # numbers cached per token and layer
    heads = per_layer / (2 * v2.head_dim)
    return Claim(SECTION, "mla-one-head", "MLA's cache is worth about one K/V head", "about 1 K/V head",
                 f"{per_layer} numbers per layer = {heads:.2f} K/V heads of {v2.head_dim} "
                 f"(1/{2 * v2.n_heads * v2.head_dim / per_layer:.0f} of its {v2.n_heads}-head MHA)", DIFFERS,
                 f"DeepSeek-V2 caches a {v2.kv_latent_dim}-wide latent plus a {v2.rope_head_dim}-wide rotary key "
                 f"per layer: {heads:.2f} heads' worth of K and V, not one", CH07)


def _gqa_savings() -> Claim:
    pairs = [("llama-2-70b", 64), ("llama-3-8b", 32), ("smollm2-135m", 9)]
    ratios = {}
    for name, heads in pairs:
        mha = model_costs({"preset": name, "n_kv_heads": heads}, "fp16").kv_bytes_per_token
        ratios[name] = mha / model_costs({"preset": name}, "fp16").kv_bytes_per_token
    in_range = all(4 <= r <= 8 for n, r in ratios.items() if n != "smollm2-135m")
    return checked(SECTION, "gqa-4-8x", "Going from MHA to GQA cuts KV bytes 4x to 8x", "4x - 8x",
                   ", ".join(f"{n} {number(r)}x" for n, r in ratios.items()), in_range,
                   "LLaMA-2 70B 64 -> 8 K/V heads, LLaMA-3 8B 32 -> 8; SmolLM2-135M's 9 -> 3 is 3x, below the range",
                   CH07)


def _gqa_adopters() -> Claim:
    l3 = model_costs({"preset": "llama-3-8b"}, "fp16").cfg
    return checked(SECTION, "gqa-adopters", "LLaMA-3 uses GQA", "LLaMA-3, Mistral use GQA",
                   f"llama-3-8b: {l3.n_heads} query heads share {l3.n_kv_heads} K/V heads",
                   l3.n_kv_heads < l3.n_heads, "Mistral 7B (32 query, 8 K/V heads) is not a preset here", CH07)


def _capacity(evidence) -> Claim:
    """The same memory admits more sequences with fewer K/V heads: ch13's budget, measured."""
    key, claim, book = "gqa-more-requests", "The same KV memory holds 4x-8x more requests after MHA -> GQA", "4x - 8x"
    run = evidence.run("ch13_gqa_mla")
    if run is None:
        return not_run(SECTION, key, claim, book, CH13, "the sequences one KV budget admits per variant")
    column = "seqs_admitted_max"
    admitted = {arm: run.arm(arm)[column] for arm in ("mha", SHIPPED, "mqa") if run.arm(arm) is not None}
    kv = {arm: run.arm(arm)["kv_bytes_per_token"] for arm in admitted}
    if "mha" not in admitted or SHIPPED not in admitted:
        return not_run(SECTION, key, claim, book, CH13, f"the mha and {SHIPPED} arms (the stored run lacks one)")
    ratio, kv_ratio = admitted[SHIPPED] / max(admitted["mha"], 1), kv["mha"] / kv[SHIPPED]
    text = ", ".join(f"{a} {int(n)}" for a, n in admitted.items())
    return measured(SECTION, key, claim, book, f"sequences admitted: {text} ({ratio:.1f}x for {kv_ratio:.0f}x "
                    "fewer KV bytes)", ratio >= int(kv_ratio),
                    f"SmolLM2's 9 -> 3 K/V heads under one budget; read from {run.label}", CH13)


def _quality(evidence) -> list[Claim]:
    """MQA costs quality, MLA keeps it: perplexity of SmolLM2 converted to each (ch13, pretrained weights)."""
    mqa = ("mqa-loses-quality", "MQA costs quality", "quality loss", ["mqa"], lambda r: r["mqa"] > LOST)
    mla = ("mla-keeps-quality", "MLA compresses further while keeping quality", "quality kept",
           ["mla_r128", "mla_r64"], lambda r: min(r.values()) <= LOST)
    run = evidence.run("ch13_gqa_mla")
    out = []
    for key, claim, book, arms, holds in (mqa, mla):
        rows = {a: run.arm(a) for a in arms} if run is not None and "ppl_ratio" in run.summary else {}
        ratios = {a: float(r["ppl_ratio"]) for a, r in rows.items() if r is not None and r["ppl_ratio"] == r["ppl_ratio"]}
        if len(ratios) < len(arms):
            out.append(not_run(SECTION, key, claim, book, CH13, "perplexity of each KV variant of the pretrained "
                               "SmolLM2 (experiment.quality.weights=pretrained)"))
            continue
        shown = ", ".join(f"{a}: perplexity x{r:,.2f}, {run.arm(a)['kv_bytes_per_token']:,.0f} KV bytes/token"
                          for a, r in ratios.items())
        out.append(measured(SECTION, key, claim, book, shown, bool(holds(ratios)),
                            "converted from the trained GQA model without any training (mean-pooled heads; SVD); "
                            f"the book's MLA is trained as such; read from {run.label}", CH13))
    return out
