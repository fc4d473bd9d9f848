"""7.6: materialised attention writes n x n scores to memory and reads them back; on-chip memory is
an order of magnitude faster than off-chip.

    one head's scores     n^2 s bytes (s = 2 in fp16)         one layer: H n^2 s
    bytes moved           materialised vs tiled: ablate.analysis.attention_io
"""
from __future__ import annotations

from ablate.analysis.attention_io import AttentionShape, materialised_bytes, tiled_bytes, triton_flash_block_m
from ablate.analysis.devices import DEVICES
from ablate.analysis.onchip import ONCHIP
from ablate.analysis.score_memory import score_bytes
from ablate.book.claims import Claim, checked, computed, in_bytes, measured, not_run

SECTION = "7.6"
BOOK = "python -m ablate book section=7.6"
CH12 = "python -m ablate +experiment=ch12_flash"
N = 32768
HEADS = 64


def claims(evidence) -> list[Claim]:
    a100, sram = DEVICES["a100-80gb"], ONCHIP["a100-80gb"]
    return [
        in_bytes(SECTION, "scores-32k", "One head's n x n scores at 32k tokens in FP16 take about 2 GB", 2, "GB",
                 score_bytes(N), 1, CH12, "the ch12 report's analytic rows; ablate's naive attention keeps fp32: twice"),
        in_bytes(SECTION, "scores-64-heads", "... 64 heads move 128 GB per attention", 128, "GB",
                 score_bytes(N, HEADS), 3, CH12, f"per layer; 80 layers: {score_bytes(N, HEADS, 80) / 2 ** 40:.0f} TiB"),
        computed(SECTION, "a100-hbm", "An A100's HBM bandwidth is about 2 TB/s", 2, "~2 TB/s",
                 a100.bandwidth_bytes_s / 1e12, f"{a100.bandwidth_bytes_s / 1e12:.3f} TB/s", 1, CH12),
        computed(SECTION, "a100-sram", "An A100's SRAM bandwidth is about 19 TB/s", 19, "~19 TB/s",
                 sram.onchip_bandwidth_bytes_s / 1e12, f"{sram.onchip_bandwidth_bytes_s / 1e12:.1f} TB/s", 2, CH12,
                 sram.onchip_source),
        _traffic(),
        _onchip_here(evidence),
        _growth_here(evidence),
    ]


def _traffic() -> Claim:
    shape = AttentionShape(N, HEADS, 8, 128, 2)
    naive, tiled = materialised_bytes(shape), tiled_bytes(shape, triton_flash_block_m(128, 2))
    return checked(SECTION, "tiling-cuts-traffic", "Tiling keeps scores on chip and moves far fewer bytes",
                   "fewer HBM round trips", f"{naive / 2 ** 40:.2f} TiB materialised against {tiled / 2 ** 30:.1f} GiB "
                   f"tiled ({naive / tiled:.0f}x)", naive > tiled,
                   f"one layer of LLaMA-2 70B's shape at {N} tokens, fp16, causal", CH12)


def _onchip_here(evidence) -> Claim:
    key, claim = "onchip-faster-here", "On-chip memory is much faster than off-chip memory"
    book_ratio = ONCHIP["a100-80gb"].onchip_bandwidth_bytes_s / DEVICES["a100-80gb"].bandwidth_bytes_s
    book = f"19 against 2 TB/s on an A100 ({book_ratio:.1f}x)"
    bandwidth = evidence.onchip
    if bandwidth is None:
        return not_run(SECTION, key, claim, book, BOOK, "a cache-resident copy against a DRAM one (book.measure)")
    return measured(SECTION, key, claim, book, f"{bandwidth.cache_bytes_s / 1e9:.0f} against "
                    f"{bandwidth.memory_bytes_s / 1e9:.0f} GB/s ({bandwidth.ratio:.1f}x)", bandwidth.ratio >= 2,
                    f"this CPU, one thread: {bandwidth.method}", BOOK)


def _growth_here(evidence) -> Claim:
    key, claim, book = "scores-grow-quadratically", "Materialised attention's memory grows as n^2", "n x n"
    run = evidence.run("ch12_flash")
    if run is None or "prompt_len" not in run.summary:
        return not_run(SECTION, key, claim, book, CH12, "peak memory per attention over prompt lengths")
    peaks = run.summary.pivot_table(index="prompt_len", columns="arm", values="peak_memory_bytes")
    if len(peaks) < 2 or "naive" not in peaks:
        return not_run(SECTION, key, claim, book, CH12, "naive attention at two lengths or more")
    (n0, n1), grown = peaks.index[-2:], peaks.iloc[-1] / peaks.iloc[-2]
    text = ", ".join(f"{arm} {g:.2f}x" for arm, g in grown.items())
    return measured(SECTION, key, claim, book, f"peak memory from {n0} to {n1} tokens: {text}",
                    bool(grown["naive"] > grown.drop("naive").max()),
                    f"weights included, so growth is below (n1/n0)^2; read from {run.label}", CH12)
