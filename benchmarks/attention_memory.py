"""Chapter 12: naive vs SDPA vs FlashAttention on one attention call, prefill of one long sequence.

    .venv/bin/python benchmarks/attention_memory.py                      # SmolLM2's shape, 1k..8k tokens
    .venv/bin/python benchmarks/attention_memory.py --lengths 256 512 --repeats 1    # a quick check

Per sequence length n and implementation (the attention plugins, called as the engine calls them on
the `none` cache: q (n, H, D) and this step's K/V packed, causal):
- time: median of `--repeats` calls after one warm-up, implementations interleaved (order
  alternating per round); each call gets fresh step inputs, so naive's (n, n) mask is built
  inside the call it is charged to;
- peak memory the call adds: torch.cuda.max_memory_allocated on a GPU, the tensor tracker of
  ablate.measure.memory on the CPU (storages allocated by ops inside the call, live at once); measured on a
  separate call from the timed ones (the tracker slows ops down);
- growth: peak(n) / peak(n / 2) for consecutive doublings;
- predicted bytes moved between memory levels (ablate.analysis.attention_io): materialised for naive (and
  SDPA's math backend), tiled for SDPA's fused backends and the Triton kernels; which one applies
  comes from the backend the call recorded. On a CPU without Triton, attention=flash runs SDPA and
  says so in `backend`.

The figure to reach on a CPU: at 8k tokens naive's peak grows about 4x per doubling (the scores are
n^2), SDPA's and flash's at most about 2x (only Q, K, V, O). Results: results/ch12_attention_memory/.
"""
from __future__ import annotations

import argparse
import gc
import statistics

import pandas as pd
import torch

from ablate.analysis.attention_io import (AttentionShape, materialised_bytes, sdpa_bytes, tiled_bytes,
                                          triton_flash_block_m)
from ablate.api import clock
from ablate.api.context import BuildContext, EngineConfig, KVSpec
from ablate.api.kv import PackedKV
from ablate.api.plugin import Slot
from ablate.api.sequence import Request, Sequence
from ablate.api.step import StepInputs
from ablate.engine.registry import default_registry
from ablate.measure import device as dev
from ablate.measure.memory import peak_memory_of
from ablate.model.config import DTYPES
from ablate.report.table_run import open_run_folder, store_tables
from ablate.report.wandb_log import WandbConfig
from ablate_attention.sdpa import sdpa_backend


def prefill_step(n: int, device: torch.device) -> StepInputs:
    """The step inputs of one sequence's whole-prompt prefill (no history), as the runner builds them."""
    seq = Sequence(Request(0, (0,) * n, max_new_tokens=1))
    return StepInputs(
        seqs=[seq], input_ids=torch.zeros(n, dtype=torch.long, device=device),
        positions=torch.arange(n, device=device), query_lens=[n], context_lens=[n], query_starts=[0, n],
        logits_indices=torch.tensor([n - 1], device=device),
        query_starts_t=torch.tensor([0, n], dtype=torch.int32, device=device))


def attention_plugins(names: list[str], device: torch.device, dtype: torch.dtype, heads: int, head_dim: int):
    registry = default_registry()
    spec = KVSpec(1, heads, head_dim, head_dim, dtype, device, 1, 1)
    ctx = BuildContext(model=None, kv_spec=spec, engine=EngineConfig(max_num_seqs=1))   # attention reads the device only
    return {name: registry.get(Slot.ATTENTION, name)(registry.config(Slot.ATTENTION, name), ctx) for name in names}


def predicted_bytes(impl: str, plugin, shape: AttentionShape, sdpa_choice: str, device_type: str) -> int:
    if impl == "naive":
        return materialised_bytes(shape)
    ran_triton = impl == "flash" and plugin.kernel in set().union(*plugin.ran.values())
    if ran_triton:
        return tiled_bytes(shape, triton_flash_block_m(shape.head_dim, shape.element_bytes))
    return sdpa_bytes(sdpa_choice, shape, device_type)


def measure(args: argparse.Namespace) -> pd.DataFrame:
    device = dev.resolve(args.device)
    dtype = DTYPES[args.dtype]
    plugins = attention_plugins(args.impls, device, dtype, args.kv_heads, args.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for n in args.lengths:
        q = torch.randn(n, args.heads, args.head_dim, generator=gen).to(device, dtype)      # (n, H, D)
        k = torch.randn(n, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)   # (n, H_kv, D)
        v = torch.randn(n, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
        view = PackedKV(k, v)
        # the backend SDPA picks for this causal prefill (as the sdpa plugin records it)
        sdpa_choice = sdpa_backend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   None, True)
        times: dict[str, list[float]] = {impl: [] for impl in args.impls}
        with torch.inference_mode():
            for impl, plugin in plugins.items():                 # warm-up
                plugin(q, view, prefill_step(n, device))
            for r in range(args.repeats):
                for impl in args.impls if r % 2 == 0 else args.impls[::-1]:
                    step = prefill_step(n, device)
                    start = clock.now(device)
                    plugins[impl](q, view, step)
                    times[impl].append(clock.now(device) - start)
            for impl, plugin in plugins.items():
                gc.collect()
                step = prefill_step(n, device)
                _, peak = peak_memory_of(lambda: plugin(q, view, step), device)  # noqa: F821 (deleted after use below)
                shape = AttentionShape(n, args.heads, args.kv_heads, args.head_dim, dtype.itemsize)
                moved = predicted_bytes(impl, plugin, shape, sdpa_choice, device.type)
                median = statistics.median(times[impl])
                rows.append({"seq_len": n, "impl": impl, "backend": plugin.backend,
                             "time_ms": 1e3 * median, "time_ms_min": 1e3 * min(times[impl]),
                             "peak_bytes": peak.bytes, "memory_method": peak.method,
                             "predicted_bytes": moved, "predicted_bytes_over_time_gb_s": moved / median / 1e9})
                print(f"n={n:>6} {impl:>6}: {1e3 * median:9.1f} ms, peak {peak.bytes / 2**20:9.1f} MiB, "
                      f"predicted {moved / 2**20:9.1f} MiB moved  [{plugin.backend}]", flush=True)
        del q, k, v, view
    frame = pd.DataFrame(rows)
    frame["peak_growth_per_doubling"] = frame.groupby("impl")["peak_bytes"].transform(
        lambda s: s / s.shift(1))
    doubled = frame.groupby("impl")["seq_len"].transform(lambda s: s / s.shift(1))
    frame.loc[doubled != 2, "peak_growth_per_doubling"] = float("nan")   # only consecutive doublings count
    return frame


def figure_check(frame: pd.DataFrame) -> list[str]:
    """The chapter's figure at the longest length measured: naive ~4x per doubling, the others <= ~2x."""
    longest = frame[frame["seq_len"] == frame["seq_len"].max()].set_index("impl")["peak_growth_per_doubling"]
    lines = []
    for impl, growth in longest.items():
        if pd.isna(growth):
            continue
        target, ok = ("about 4x", 3.5 <= growth <= 4.5) if impl == "naive" else ("at most about 2x", growth <= 2.2)
        lines.append(f"{impl}: peak memory x{growth:.2f} per doubling at n={frame['seq_len'].max()} "
                     f"(target {target}: {'reached' if ok else 'NOT reached'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--impls", nargs="+", default=["naive", "sdpa", "flash"])
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="K/V heads (SmolLM2-135M: 3)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir", "wandb")}
    frame = measure(args)
    checks = figure_check(frame)
    table = frame.assign(time_ms=frame["time_ms"].round(2), peak_MiB=(frame["peak_bytes"] / 2**20).round(2),
                         predicted_MiB=(frame["predicted_bytes"] / 2**20).round(1),
                         growth=frame["peak_growth_per_doubling"].round(2))[
        ["seq_len", "impl", "time_ms", "peak_MiB", "growth", "predicted_MiB", "backend"]]
    print("\n" + table.to_string(index=False))
    print("\n" + "\n".join(checks))
    device = dev.resolve(args.device)
    folder = open_run_folder(args.results_dir, "ch12_attention_memory", config, device)
    report = "\n".join(["# ch12: attention memory and time, prefill of one sequence", "",
                        table.to_markdown(index=False), "", *[f"- {c}" for c in checks],
                        f"- peak memory: {frame['memory_method'].iloc[0]}; predicted bytes: ablate/analysis/attention_io.py"]) + "\n"
    summary = {f"peak_bytes/{r.impl}/n={r.seq_len}": float(r.peak_bytes) for r in frame.itertuples()}
    summary |= {f"time_ms/{r.impl}/n={r.seq_len}": float(r.time_ms) for r in frame.itertuples()}
    wandb_dir = store_tables(folder, experiment="ch12_attention_memory", chapter="ch12", config=config,
                             tables={"attention": frame}, report=report, summary=summary,
                             wandb=WandbConfig(mode=args.wandb), tags=args.impls)
    print(f"\nresults: {folder.path}" + (f"\nW&B run: {wandb_dir}" if wandb_dir else ""))


if __name__ == "__main__":
    main()
