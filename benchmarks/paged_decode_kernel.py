"""The CPU's paged decode attention kernel on its own: time per call and the K/V bytes it reads a second.

    .venv/bin/python benchmarks/paged_decode_kernel.py [--batch 1 64] [--context 200] [--rounds 15]
                                                       [--against REV]

One decode step of one layer of SmolLM2-135M's attention (9 query heads over 3 KV heads, head dim
64, fp32, blocks of 16 tokens handed out in a shuffled order), over the KV pool a batch of sequences
holds at --context tokens each (engines_serving: 128-token prompts, up to 128 new tokens). Per batch
size, interleaved round by round on torch's threads: the native kernel (ablate/model/native/
paged_attention.c, reading each block where it lies) and the PyTorch path attention=paged falls back
to (the blocks gathered through the tables, then SDPA); the geometric mean time of a call and its 95%
interval over rounds, and the K and V bytes the step reads over that time. The pool is larger than the
machine's caches so that every call reads its blocks from memory, as a layer's do in a step.
--against REV adds the kernel as it was at git revision REV (its paged_attention.c and vectors.h,
compiled with the same flags into a library of its own) to the same rounds, checked against the gather.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import time

import torch
import torch.nn.functional as F

from ablate.analysis.stats import log_interval
from ablate.measure import cpu_load
from ablate.model import native
from native_at_revision import function_at

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
POOL_BYTES = 1 << 30       # each call reads a different slice of a pool this large: from memory, not the caches


def case(batch: int, context: int, copies: int, gen: torch.Generator):
    """`copies` independent steps' inputs, each over blocks of its own -> list of (q, tables, lens), and the
    shared pools k, v (N, BLOCK, KV_HEADS, HEAD_DIM)."""
    per_seq = -(-context // BLOCK)
    num_blocks = per_seq * batch * copies
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(copies, batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return [(torch.randn(batch, HEADS, HEAD_DIM, generator=gen), order[c], lens) for c in range(copies)], k, v


def gathered(q, k, v, tables, lens):
    """attention=paged's PyTorch path for a decode step: every sequence's blocks gathered, then SDPA."""
    kb = k[tables.long()].flatten(1, 2).transpose(1, 2)             # (B, H_kv, S, D)
    vb = v[tables.long()].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(kb.shape[2])[None, :] < lens[:, None]        # (B, S)
    out = F.scaled_dot_product_attention(q[:, :, None], kb, vb, attn_mask=mask[:, None, None], enable_gqa=True)
    return out[:, :, 0]                                              # (B, H, D)


def kernel_at(revision: str):
    """The paged-decode kernel as it was at `revision`, compiled here with the library's flags, called as
    native.paged_decode_attention calls today's: (q, k, v, tables, lens, threads) -> (B, H, D)."""
    function = function_at(revision, "paged_attention.c", "paged_decode_attention")

    def run(q, k, v, tables, lens, threads):
        out = torch.empty_like(q)
        function(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
                 q.shape[0], HEADS, KV_HEADS, HEAD_DIM, BLOCK, tables.shape[1], HEAD_DIM ** -0.5, threads)
        return out
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", metavar="REV", help="also time the kernel as it was at this git revision")
    args = parser.parse_args()
    if native.library() is None:
        raise SystemExit(f"no native kernels here: {native.unavailable_reason()}")
    earlier = kernel_at(args.against) if args.against else None
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    print(f"{threads} threads; {HEADS} heads over {KV_HEADS} KV heads, D={HEAD_DIM}, blocks of {BLOCK}, "
          f"context {args.context}")
    print("| batch | kernel | µs per call [95% CI] | K+V GB/s | vs gather | CPU left to it |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        step_bytes = 2 * batch * args.context * KV_HEADS * HEAD_DIM * 4
        copies = max(2, POOL_BYTES // step_bytes)
        steps, k, v = case(batch, args.context, copies, gen)
        ways = {"native": lambda q, t, n: native.paged_decode_attention(q, k, v, t, n, threads),
                "gather + SDPA": lambda q, t, n: gathered(q, k, v, t, n)}
        if earlier is not None:
            ways[f"native at {args.against}"] = lambda q, t, n: earlier(q, k, v, t, n, threads)
        q, t, n = steps[0]
        for name, way in ways.items():
            torch.testing.assert_close(way(q, t, n), ways["gather + SDPA"](q, t, n), atol=1e-4, rtol=1e-4,
                                       msg=lambda why, name=name: f"{name} against the gather: {why}")
        times: dict[str, list[float]] = {name: [] for name in ways}
        with cpu_load.CpuShareMeter(threads) as meter:
            for r in range(args.rounds):
                for name, way in ways.items():
                    q, t, n = steps[(r * len(ways) + list(ways).index(name)) % copies]
                    start = time.perf_counter()
                    way(q, t, n)
                    times[name].append(time.perf_counter() - start)
        share = f"{meter.share.cpu_left_share:.2f}" if meter.share else "not read"
        gather = log_interval(times["gather + SDPA"]).center
        for name, seconds in times.items():
            spread = log_interval(seconds)
            mid = spread.center
            print(f"| {batch} | {name} | {mid * 1e6:.0f} [{spread.low * 1e6:.0f}, {spread.high * 1e6:.0f}] | "
                  f"{step_bytes / mid / 1e9:.1f} | {gather / mid:.2f}x | {share} |")


if __name__ == "__main__":
    main()
