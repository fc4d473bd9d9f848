"""Time the ablate_kernels Triton attention kernels against PyTorch SDPA on a CUDA GPU.

    python benchmarks/kernels_gpu.py [--out kernels_gpu.json] [--repeats 20] [--warmup 5] [--configs]

Measures, in bf16, with CUDA events after warm-up (median over repeats):
  1. flash_attention_varlen, causal prefill of one sequence of 4k / 8k / 16k tokens, head_dim 64 and
     128, H=32 query heads, H_kv=8, against scaled_dot_product_attention(is_causal=True), taking the
     fastest SDPA backend with native GQA (enable_gqa=True) or with K/V repeated to H heads beforehand;
  2. paged_decode_attention (batch 32, context 4k, block size 16, shuffled block table) against SDPA
     over the same tokens laid out contiguously;
  3. flash_attention_decode (same shapes, contiguous padded cache) against SDPA.
Prints a table and writes the figures as JSON. speedup = sdpa_ms / triton_ms (> 1: Triton faster).
The prefill picks its tile config by timing (ablate_kernels/tuning.py) on its first call per shape
bucket, before timing starts; each row records the config it picked (autotuned_config) and whether
any kernel compiled during the timed calls (compiled_during_timing, which should stay false).
--configs (alias --sweep) also times every prefill candidate config per shape (what the autotuner
chose from, so the next GPU session sees which wins) and decode BLOCK_N x split counts (slower).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import ablate_kernels
except ImportError:  # run from a checkout without `pip install -e kernels`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    import ablate_kernels

from ablate_kernels import decode_attention as da
from ablate_kernels import flash_attention as fa
from ablate_kernels import launch, tuning
from ablate_kernels import paged_attention as pa

DEVICE = "cuda"  # a dry run of the script's logic can point this at the CPU interpreter
DTYPE = torch.bfloat16
NUM_HEADS, NUM_KV_HEADS = 32, 8
PREFILL_LENGTHS = (4096, 8192, 16384)
PREFILL_HEAD_DIMS = (64, 128)
DECODE_BATCH, DECODE_CONTEXT, DECODE_HEAD_DIM, BLOCK_SIZE = 32, 4096, 128, 16


def time_ms(fn, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median milliseconds per call; each repeat times `inner` back-to-back calls between two events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def sdpa_backends():
    """(label, context manager factory) for each SDPA backend that can be forced.

    The math backend is left out: it materialises the scores (34 GB at 16k tokens) and is never the best.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    choices = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is not None:
            choices.append((name.lower(), lambda backend=backend: sdpa_kernel([backend])))
    return choices


def best_sdpa(q, k, v, is_causal: bool, warmup: int, repeats: int, inner: int = 1):
    """Fastest SDPA over backends and GQA modes. q: (B, H, Lq, D); k, v: (B, H_kv, Lk, D).

    Returns (ms, label, output (B, H, Lq, D)); K/V repetition for the non-GQA mode is done outside timing.
    """
    group = q.shape[1] // k.shape[1]
    k_rep = k.repeat_interleave(group, dim=1)  # (B, H, Lk, D)
    v_rep = v.repeat_interleave(group, dim=1)  # (B, H, Lk, D)
    best = (math.inf, "none", None)
    for label, ctx in sdpa_backends():
        for mode, kk, vv, gqa in (("gqa", k, v, True), ("repeat_kv", k_rep, v_rep, False)):
            def call():
                with ctx():
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=is_causal, enable_gqa=gqa)
            try:
                with warnings.catch_warnings():  # "backend not available because ..." warnings
                    warnings.simplefilter("ignore")
                    out = call()
                    ms = time_ms(call, warmup, repeats, inner)
            except (RuntimeError, ValueError, NotImplementedError):  # backend unsupported for this shape / mode
                continue
            if ms < best[0]:
                best = (ms, f"{label}/{mode}", out)
    del k_rep, v_rep
    return best


def bench_prefill(args) -> list[dict]:
    rows = []
    for head_dim in PREFILL_HEAD_DIMS:
        for seqlen in PREFILL_LENGTHS:
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            q = torch.randn(seqlen, NUM_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (T, H, D)
            k = torch.randn(seqlen, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (T, H_kv, D)
            v = torch.randn(seqlen, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (T, H_kv, D)
            cu = torch.tensor([0, seqlen], device=DEVICE, dtype=torch.int32)  # (B+1,)

            def triton_call():
                return ablate_kernels.flash_attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=True)  # noqa: F821 (deleted after use below)

            out = triton_call()  # the first call of a length bucket autotunes (outside the timing)
            picked = tuning.last_prefill_config()
            triton_ms, compiled = time_counting_variants(triton_call, args, inner=1)
            sdpa_ms, sdpa_label, sdpa_out = best_sdpa(
                q.transpose(0, 1).unsqueeze(0).contiguous(),  # (1, H, T, D)
                k.transpose(0, 1).unsqueeze(0).contiguous(),  # (1, H_kv, T, D)
                v.transpose(0, 1).unsqueeze(0).contiguous(),  # (1, H_kv, T, D)
                True, args.warmup, args.repeats)
            # causal: half of the two (T x T x D) matmuls per head
            flops = 4 * NUM_HEADS * seqlen * seqlen * head_dim / 2
            row = {
                "bench": "prefill_varlen", "seqlen": seqlen, "head_dim": head_dim, "heads": NUM_HEADS,
                "kv_heads": NUM_KV_HEADS, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms, "sdpa_backend": sdpa_label,
                "triton_tflops": flops / triton_ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
                "speedup": sdpa_ms / triton_ms,
                "max_abs_diff": (out.float() - sdpa_out[0].transpose(0, 1).float()).abs().max().item(),
                "autotuned_config": picked, "seqlen_bucket": tuning.seqlen_bucket(seqlen),
                "compiled_during_timing": compiled,
            }
            if args.configs:
                row["configs"] = time_prefill_candidates(q, k, v, cu, seqlen, head_dim, args)
            rows.append(row)
            print_row(row)
            del q, k, v, out, sdpa_out
            torch.cuda.empty_cache()
    return rows


def time_prefill_candidates(q, k, v, cu, seqlen, head_dim, args) -> list[dict]:
    """Milliseconds of every candidate tile config the autotuner chooses from, for this shape."""
    results = []
    out = torch.empty_like(q)
    scale, group = 1.0 / math.sqrt(head_dim), NUM_HEADS // NUM_KV_HEADS
    for config in tuning.prefill_candidates(head_dim, DTYPE):
        try:
            ms = time_ms(lambda: fa._launch_varlen(q, k, v, cu, cu, seqlen, out, group, True, scale, config),
                         2, max(args.repeats // 2, 5))
            results.append({**config, "ms": ms})
        except Exception as exc:  # e.g. out of shared memory on this GPU
            results.append({**config, "error": type(exc).__name__})
        print(f"    config T={seqlen} D={head_dim} {results[-1]}")
    return results


def time_counting_variants(fn, args, inner: int = 10) -> tuple[float, bool]:
    """(time_ms of fn, whether a kernel variant was compiled while timing: it should not be)."""
    variants = ablate_kernels.compiled_variants()
    ms = time_ms(fn, args.warmup, args.repeats, inner)
    return ms, ablate_kernels.compiled_variants() != variants


def make_decode_inputs():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    batch, ctx, head_dim = DECODE_BATCH, DECODE_CONTEXT, DECODE_HEAD_DIM
    q = torch.randn(batch, NUM_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (B, H, D)
    k = torch.randn(batch, ctx, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (B, S, H_kv, D)
    v = torch.randn(batch, ctx, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE, generator=gen)  # (B, S, H_kv, D)
    context_lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)  # (B,)
    return q, k, v, context_lens


def decode_row(name, triton_ms, sdpa, out, extra=None) -> dict:
    sdpa_ms, sdpa_label, sdpa_out = sdpa
    kv_bytes = 2 * DECODE_BATCH * DECODE_CONTEXT * NUM_KV_HEADS * DECODE_HEAD_DIM * 2  # K and V, bf16
    row = {
        "bench": name, "batch": DECODE_BATCH, "context": DECODE_CONTEXT, "head_dim": DECODE_HEAD_DIM,
        "heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
        "sdpa_backend": sdpa_label, "triton_gbps": kv_bytes / triton_ms / 1e6, "sdpa_gbps": kv_bytes / sdpa_ms / 1e6,
        "speedup": sdpa_ms / triton_ms,
        "max_abs_diff": (out.float() - sdpa_out[:, :, 0].float()).abs().max().item(),
        **(extra or {}),
    }
    print_row(row)
    return row


def bench_decode(args) -> list[dict]:
    q, k, v, context_lens = make_decode_inputs()
    # SDPA over the same tokens, contiguous: q (B, H, 1, D), k/v (B, H_kv, S, D); no mask needed, all full
    sdpa = best_sdpa(q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), False,
                     args.warmup, args.repeats, inner=10)
    rows = []

    # paged: scatter the same tokens into a pool of blocks through a shuffled block table
    blocks_per_seq = DECODE_CONTEXT // BLOCK_SIZE
    num_blocks = DECODE_BATCH * blocks_per_seq
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    block_tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(DECODE_BATCH, blocks_per_seq)
    block_tables = block_tables.to(torch.int32)  # (B, max_blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, DECODE_HEAD_DIM)
    k_cache = torch.empty(cache_shape, device=DEVICE, dtype=DTYPE)  # (num_blocks, block_size, H_kv, D)
    v_cache = torch.empty(cache_shape, device=DEVICE, dtype=DTYPE)
    flat = block_tables.flatten().long()
    k_cache.index_copy_(0, flat, k.reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, DECODE_HEAD_DIM))
    v_cache.index_copy_(0, flat, v.reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, DECODE_HEAD_DIM))

    def paged_call():
        return ablate_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)

    config = launch._decode_config(DECODE_HEAD_DIM, DTYPE)
    splits = launch._num_splits(DECODE_BATCH * NUM_KV_HEADS, DECODE_CONTEXT, config["BLOCK_N"], q.device)
    out = paged_call()
    ms, compiled = time_counting_variants(paged_call, args)
    rows.append(decode_row("paged_decode", ms, sdpa, out, {"block_size": BLOCK_SIZE, "num_splits": splits,
                                                             "compiled_during_timing": compiled}))

    def decode_call():
        return ablate_kernels.flash_attention_decode(q, k, v, context_lens)

    out = decode_call()
    ms, compiled = time_counting_variants(decode_call, args)
    rows.append(decode_row("flash_decode", ms, sdpa, out, {"num_splits": splits, "compiled_during_timing": compiled}))

    group, scale = NUM_HEADS // NUM_KV_HEADS, 1.0 / math.sqrt(DECODE_HEAD_DIM)
    for block_n in (32, 64, 128) if args.configs else ():  # split counts x key tiles; `splits` is the chosen
        for num_splits in (1, 2, 4, 8, 16, 32):
            cfg = {**config, "BLOCK_N": block_n}
            paged_ms = time_ms(lambda: pa._launch_paged(q, k_cache, v_cache, block_tables, context_lens, group,
                                                        scale, num_splits, cfg), 2, 10, inner=10)
            dec_ms = time_ms(lambda: da._launch_decode(q, k, v, context_lens, group, scale, num_splits, cfg),
                             2, 10, inner=10)
            chosen = block_n == config["BLOCK_N"] and num_splits == splits
            print(f"    config {cfg} splits={num_splits}: paged {paged_ms:.4f} ms, decode {dec_ms:.4f} ms"
                  f"{'  (chosen)' if chosen else ''}")
            rows.append({"bench": "decode_configs", **cfg, "num_splits": num_splits, "chosen": chosen,
                         "paged_ms": paged_ms, "decode_ms": dec_ms})
    return rows


HEADER = f"{'bench':<15}{'shape':<24}{'triton ms':>10}{'sdpa ms':>10}{'triton':>12}{'sdpa':>12}{'speedup':>9}" \
         f"{'max|diff|':>11}  sdpa backend"


def print_row(row: dict) -> None:
    if row["bench"] == "prefill_varlen":
        shape = f"T={row['seqlen']} D={row['head_dim']}"
        rates = f"{row['triton_tflops']:>7.1f} TF/s{row['sdpa_tflops']:>7.1f} TF/s"
    else:
        shape = f"B={row['batch']} ctx={row['context']} D={row['head_dim']}"
        rates = f"{row['triton_gbps']:>7.0f} GB/s{row['sdpa_gbps']:>7.0f} GB/s"
    print(f"{row['bench']:<15}{shape:<24}{row['triton_ms']:>10.3f}{row['sdpa_ms']:>10.3f}{rates}"
          f"{row['speedup']:>9.2f}{row['max_abs_diff']:>11.2e}  {row['sdpa_backend']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("kernels_gpu.json"), help="where to write the JSON figures")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median reported)")
    parser.add_argument("--configs", "--sweep", dest="configs", action="store_true",
                        help="also time every prefill candidate config per shape and decode BLOCK_N x split counts")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time.",
              file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    print(f"device: {device_name}, torch {torch.__version__}, dtype {DTYPE}, H={NUM_HEADS}, H_kv={NUM_KV_HEADS}")
    print(HEADER)
    results = {
        "device": device_name, "torch": torch.__version__, "triton": __import__("triton").__version__,
        "dtype": str(DTYPE), "backend": ablate_kernels.backend_label(DEVICE),
        "prefill": bench_prefill(args),
        "decode": bench_decode(args),
        "compiled_variants": ablate_kernels.compiled_variants(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
