"""ablate's elementwise CPU kernels against torch's operations: RMSNorm, RoPE and SwiGLU's activation.

    .venv/bin/python benchmarks/elementwise_kernels.py [--rows 1 16 64 256 2048 8192] [--calls 60]

At SmolLM2-135M's widths (d_model 576, 9 + 3 heads of 64, d_ff 1536), fp32 (and RMSNorm in bf16, on
a CPU that has bf16 units), per row count: the median time of a call of each, every call right after
a 7 MB matrix product, as in a step, where the weights have just pushed x out of the caches; the
native kernel (ablate/model/native/steps.c: one pass, its rows split between torch's threads once a
call is large) against the composite torch runs without it (rms_norm: six operations; RoPE: six;
silu(gate) * up: three). Interleaved call by call; the CPU's load is printed beside the table.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ablate.measure import cpu_load
from ablate.model import native

D_MODEL, HEADS, HEAD_DIM, D_FF = 576, 12, 64, 1536


def torch_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's torch path: rotate-half, q (T, H, D), cos and sin (T, 1, D)."""
    q1, q2 = q.chunk(2, dim=-1)
    return q * cos + torch.cat((-q2, q1), dim=-1) * sin


def cases(rows: int, bf16: bool) -> dict[str, tuple]:
    """name -> (torch's way, the native kernel) on inputs of `rows` tokens."""
    x, w = torch.randn(rows, D_MODEL), torch.randn(D_MODEL)
    gate_up = torch.randn(rows, 2 * D_FF)
    q, cos, sin = torch.randn(rows, HEADS, HEAD_DIM), torch.randn(rows, 1, HEAD_DIM), torch.randn(rows, 1, HEAD_DIM)
    found = {
        "rms_norm fp32": (lambda: F.rms_norm(x, (D_MODEL,), w, 1e-5), lambda: native.rms_norm(x, w, 1e-5)),
        "rope fp32": (lambda: torch_rope(q, cos, sin), lambda: native.rope(q, cos, sin)),
        "silu(gate) * up fp32": (lambda: F.silu(gate_up[:, :D_FF]) * gate_up[:, D_FF:], lambda: native.silu_mul(gate_up)),
    }
    if bf16:
        xb, wb = x.bfloat16(), w.bfloat16()
        found["rms_norm bf16"] = (lambda: F.rms_norm(xb.float(), (D_MODEL,), eps=1e-5).bfloat16() * wb,
                                  lambda: native.rms_norm(xb, wb, 1e-5))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048, 8192])
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"no native kernels here: {native.unavailable_reason()}")
    weights = [torch.randn(3072, D_MODEL) for _ in range(16)]      # 7 MB each: a step's products, streamed
    x_w = torch.randn(64, D_MODEL)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    cpus = cpu_load.usable_cpus()
    before = cpu_load.read(cpus)
    print(f"{torch.get_num_threads()} threads; us per call, median of {args.calls}, each after a 7 MB product")
    print("| rows | operation | torch | native | native faster |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        for name, (torch_way, native_way) in cases(rows, bf16).items():
            torch.testing.assert_close(native_way(), torch_way(), atol=2e-2 if "bf16" in name else 1e-5, rtol=1e-2)
            times: tuple[list[float], list[float]] = ([], [])
            for call in range(args.calls):
                for way, into in ((torch_way, times[0]), (native_way, times[1])):
                    F.linear(x_w, weights[call % len(weights)])
                    start = time.perf_counter()
                    way()
                    into.append(time.perf_counter() - start)
            t, n = (statistics.median(ts) * 1e6 for ts in times)
            print(f"| {rows} | {name} | {t:.0f} | {n:.0f} | {t / n:.2f}x |", flush=True)
    after = cpu_load.read(cpus)
    if before and after:
        share = cpu_load.share_between(before, after, torch.get_num_threads(), len(cpus))
        print(f"CPU left to this run: {share.cpu_left_share:.2f} (others ran {share.others_cores:.2f} cores); "
              f"load {share.load_1m:.2f}")


if __name__ == "__main__":
    main()
