"""7.3: the KV cache's bytes, per token, per request, and against a server's memory.

    KV bytes per token      2 L H_kv d_h e
    one request at c        c x that;   N requests: N c x that
    a server of N devices   memory N M; left for KV: N M - W (tensor parallel: ablate/analysis/servers.py)
    reserved for the maximum length m, a request of n tokens wastes m - n slots: 1 - n / m of them
"""
from __future__ import annotations

from ablate.analysis.devices import server_spec
from ablate.analysis.model_costs import model_costs
from ablate.analysis.servers import ServerCosts
from ablate.book.claims import DIFFERS, Claim, checked, computed, in_bytes, measured, not_run

SECTION = "7.3"
BOOK = "python -m ablate book section=7.3"
CH07 = "python -m ablate +experiment=ch07_costs"
CH09 = "python -m ablate +experiment=ch09_paged"
SERVER = "4xa100-80gb"
CONTEXT = 4096


def claims(evidence) -> list[Claim]:
    # the book's setting: 64 K/V heads beside the real model's weights (as ch07's llama-2-70b-book row)
    book = model_costs({"preset": "llama-2-70b", "n_kv_heads": 64, "weights_of": "llama-2-70b"}, "fp16")
    real = model_costs({"preset": "llama-2-70b"}, "fp16")
    on_book, on_real = ServerCosts(book, server_spec(SERVER)), ServerCosts(real, server_spec(SERVER))
    per_token = book.kv_bytes_per_token
    request = CONTEXT * per_token
    left = on_book.memory_left
    return [
        computed(SECTION, "kv-per-token-70b", "LLaMA-2 70B's shape with 64 K/V heads stores this many KV bytes per "
                 "token in FP16", 2_621_440, "2,621,440 bytes", per_token, f"{per_token:,} bytes", 7, CH07),
        in_bytes(SECTION, "kv-per-token-70b-mb", "... about 2.5 MB", 2.5, "MB", per_token, 2, BOOK),
        Claim(SECTION, "llama70b-kv-heads", "LLaMA-2 70B keeps 64 K/V heads per layer", "64 K/V heads",
              f"{real.kv_heads} K/V heads: {real.kv_bytes_per_token:,} bytes per token", DIFFERS,
              "the released LLaMA-2 70B uses GQA (64 query heads share 8 K/V heads): 8x fewer KV bytes than "
              "the book's setting; both are computed here", CH07),
        in_bytes(SECTION, "context-4096", "A 4096-token context takes about 10 GB", 10, "GB", request, 2, CH07,
                 f"with the real 8 K/V heads: {CONTEXT * real.kv_bytes_per_token / 2 ** 30:.2f} GiB"),
        in_bytes(SECTION, "server-memory", "4 A100 80GB hold 320 GB", 320, "GB", on_book.server.memory_bytes, 3,
                 CH07, "datasheet GB"),
        in_bytes(SECTION, "room-for-kv", "Weights take ~140 GB, leaving ~180 GB for KV", 180, "GB", left,
                 3, CH07, f"weights {real.weight_bytes / 1e9:.0f} GB ({real.params_total / 1e9:.1f}B parameters), "
                 f"{real.weight_bytes / 4e9:.1f} GB a device with tensor parallelism over 4"),
        _hundred_requests(request, left),
        computed(SECTION, "six-times-over", "... about 6x the memory left", 6, "nearly 6x",
                 100 * request / left, f"{100 * request / left:.1f}x", 1, BOOK),
        in_bytes(SECTION, "ten-requests", "Ten such requests need about 102 GB", 102, "GB", 10 * request, 3, BOOK,
                 "the book's 102.4 is 10 x 10.24, the same mix of units as the 1,024"),
        _ten_requests_share(left, on_real, request),
        computed(SECTION, "preallocation-waste", "Reserving 4096 slots for a 200-token reply wastes 3896",
                 3896, "3,896 slots", CONTEXT - 200, f"{CONTEXT - 200:,} slots ({1 - 200 / CONTEXT:.1%})", 4, BOOK),
        _utilisation(evidence),
    ]


def _hundred_requests(request: float, left: float) -> Claim:
    total = 100 * request
    return Claim(SECTION, "hundred-requests", "100 requests of 4096 tokens need about 1,024 GB", "1,024 GB",
                 f"{total / 2 ** 30:,.0f} GiB = {total / 1e9:,.0f} GB", DIFFERS,
                 "the book multiplies 2.5 MB (a 2^20 reading) and divides by 1,000 (a 10^9 reading); read "
                 f"consistently it is 1,000 GiB or 1,074 GB, {total / left:.1f}x the {left / 1e9:.0f} GB left", BOOK)


def _ten_requests_share(left: float, on_real: ServerCosts, request: float) -> Claim:
    share = 10 * request / left
    return checked(SECTION, "ten-requests-share", "... which nearly exhausts the memory left", "nearly all of 180 GB",
                   f"{share:.0%} of it; {int(left // request)} requests of {CONTEXT} fit "
                   f"({int(on_real.max_requests(CONTEXT))} with the real 8 K/V heads)", share > 0.9,
                   "ten use well over half, not nearly all", BOOK)


def _utilisation(evidence) -> Claim:
    key, claim, book = "kv-utilisation", "Reserved KV is used only 20%-40% (waste and fragmentation)", "20% - 40%"
    run = evidence.run("ch09_paged")
    if run is None or run.arm("contiguous") is None:
        return not_run(SECTION, key, claim, book, CH09, "KV utilisation of a contiguous cache against paged ones")
    rows = {arm: run.arm(arm) for arm in run.summary["arm"]}
    util = {arm: float(row["kv_util_mean"]) for arm, row in rows.items()}
    contiguous = util["contiguous"]
    return measured(SECTION, key, claim, book, ", ".join(f"{a} {u:.0%}" for a, u in util.items()),
                    0.2 <= contiguous <= 0.4, f"mean KV utilisation (used / reserved) over the run; requests "
                    f"average a quarter of the maximum length; read from {run.label}", CH09)

