"""The sections of benchmarks/gpu_check.py: one function each, taking its Context, returning a dict
(optionally with "status" and a one-line "headline"); an exception is recorded by the runner.

Imported only after gpu_check.py has settled TRITON_INTERPRET (dry run / no CUDA: the interpreter).
"""
from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}     # atol = rtol, as in kernels/tests


def median_ms(fn, warmup: int = 3, repeats: int = 10, cuda: bool = True) -> float:
    """Median milliseconds per call: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def environment(ctx) -> dict:
    """The device as ablate records it (ablate.measure.device.describe: GPU provenance from torch and
    nvidia-smi, TF32 flags) and its two ceilings, measured by ablate.measure.hardware's probes (CUDA
    events on random data: a 4 GiB device-to-device copy, an 8192^3 bf16 matmul; tiny on a dry run)."""
    import triton

    from ablate.measure import device as dev
    from ablate.measure import hardware
    cuda = not ctx.dry
    device = torch.device(ctx.device)
    r = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
         **dev.describe(device)}
    copy_bytes = (4 << 30) if cuda else (64 << 20)
    ctx.measured["copy_bytes_s"] = hardware.measure_bandwidth(device, copy_bytes)
    ctx.measured["matmul_flops"] = hardware.measure_flops(device, torch.bfloat16, n=256)   # CUDA: sized for the GPU
    r |= {"copy_buffer_mib": copy_bytes >> 20, "copy_gb_s": ctx.measured["copy_bytes_s"] / 1e9,
          "bf16_matmul_tflops": ctx.measured["matmul_flops"] / 1e12}
    r["random_weights_s"] = _random_weights_s("tiny" if ctx.dry else "llama-3.2-1b", device)
    name = r["gpu"]["name"] if cuda else "CPU (dry run)"
    r["headline"] = (f"{name}: copy {r['copy_gb_s']:.0f} GB/s, bf16 matmul {r['bf16_matmul_tflops']:.3g} TFLOP/s; "
                     f"random weights in {r['random_weights_s']:.2f} s; torch {r['torch']}, triton {r['triton']}")
    return r


def _random_weights_s(model: str, device: torch.device) -> float:
    """Seconds to build the random model every CLI run of this check builds (LlamaModel.random, in the
    model's dtype on the device): what each of those runs pays before its first step."""
    from ablate.model.presets import preset
    from ablate.model.llama import LlamaModel
    started = time.perf_counter()
    model = LlamaModel.random(preset(model), device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def _kernel_info(device: str) -> dict:
    """What runs the kernels here ("triton", "triton-interpreted") and how many variants compiled so far."""
    import ablate_kernels as ak
    return {"backend": ak.backend_label(device), "compiled_variants": ak.compiled_variants()}


def _errors(out: torch.Tensor, ref: torch.Tensor, dtype) -> dict:
    """max |out - ref|, that over max |ref| (a norm-wise relative error), and the tests' allclose."""
    out, ref, tol = out.float(), ref.float(), TOLERANCE[dtype]
    diff = (out - ref).abs().max().item()
    return {"max_abs_err": diff, "max_rel_err": diff / max(ref.abs().max().item(), 1e-6), "tol": tol,
            "pass": bool(torch.isfinite(out).all()) and torch.allclose(out, ref, atol=tol, rtol=tol)}


def _kernel_cases(dtype, head_dim: int, group: int, dry: bool, device: str) -> list[dict]:
    import ablate_kernels as ak
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    kv_heads, heads = 2, 2 * group
    # ragged: a one-token sequence, lengths off the tile sizes, and queries after a cached prefix (q < k)
    q_lens, k_lens = ([1, 7, 33], [1, 12, 40]) if dry else ([1, 127, 500, 1031], [1, 127, 800, 1048])
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (q_lens, k_lens))
    q = rand(sum(q_lens), heads, head_dim)                                                  # (T_q, H, D)
    k, v = rand(sum(k_lens), kv_heads, head_dim), rand(sum(k_lens), kv_heads, head_dim)    # (T_k, H_kv, D)
    out = ak.flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=True)
    ref = ak.flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True)
    cases = [{"kernel": "flash_attention_varlen", **_errors(out, ref, dtype)}]
    ctx_lens = [1, 17, 48] if dry else [1, 130, 1000, 4097]
    block, batch, s_max = 16, len(ctx_lens), -(-max(ctx_lens) // 16) * 16
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    qd = rand(batch, heads, head_dim)                                                        # (B, H, D)
    kd, vd = rand(batch, s_max, kv_heads, head_dim), rand(batch, s_max, kv_heads, head_dim)  # (B, S, H_kv, D)
    out = ak.flash_attention_decode(qd, kd, vd, lens)
    ref = ak.flash_attention_decode_ref(qd.float(), kd.float(), vd.float(), lens)
    cases.append({"kernel": "flash_attention_decode", **_errors(out, ref, dtype)})
    # paged: a shuffled block table over a pool with spare (garbage) blocks
    per_seq, num_blocks = s_max // block, batch * (s_max // block) + 3
    table = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(device, torch.int32)
    k_cache, v_cache = (rand(num_blocks, block, kv_heads, head_dim) for _ in range(2))
    out = ak.paged_decode_attention(qd, k_cache, v_cache, table, lens)
    ref = ak.paged_decode_attention_ref(qd.float(), k_cache.float(), v_cache.float(), table, lens)
    cases.append({"kernel": "paged_decode_attention", **_errors(out, ref, dtype)})
    return [{**c, "dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "group": group} for c in cases]


def correctness_combos(dry: bool) -> list[tuple]:
    """(dtype, head_dim, group) to check. On the GPU every head dim with every group, the dtype alternating
    so that each dtype also meets every head dim and every group (a pairwise cover: 12 of the 24
    combinations, each compiling its own kernel variants cold); on the dry run a handful."""
    if dry:
        return [(torch.bfloat16, 64, 1), (torch.float16, 128, 3), (torch.bfloat16, 256, 9), (torch.float16, 64, 4)]
    dtypes = (torch.bfloat16, torch.float16)
    return [(dtypes[(i + j) % 2], d, g) for i, d in enumerate((64, 128, 256)) for j, g in enumerate((1, 3, 4, 9))]


def kernel_correctness(ctx) -> dict:
    combos, cases = correctness_combos(ctx.dry), []
    for done, combo in enumerate(combos):
        if ctx.remaining() <= 0:
            break
        cases += _kernel_cases(*combo, ctx.dry, ctx.device)
        ctx.progress({"combos_done": done + 1, "combos": len(combos), "cases": cases})
    failed = [c for c in cases if not c["pass"]]
    checked = len({(c["dtype"], c["head_dim"], c["group"]) for c in cases})
    if not cases:
        return {"status": "failed", "cases": [], "headline": "the deadline came before the first combination"}
    worst = max(cases, key=lambda c: c["max_rel_err"])
    cut = "" if checked == len(combos) else f"; cut short at the deadline: {checked}/{len(combos)} combinations"
    return {"status": "failed" if failed else "partial" if cut else "ok", **_kernel_info(ctx.device), "cases": cases,
            "headline": f"{len(cases) - len(failed)}/{len(cases)} pass; worst max_rel_err {worst['max_rel_err']:.2e}"
                        f" ({worst['kernel']} {worst['dtype']} d{worst['head_dim']} g{worst['group']}){cut}"}


def _prefill_row(kg, seqlen: int, head_dim: int, heads: int, kv_heads: int, ctx) -> dict:
    """Flash prefill against each SDPA backend kernels_gpu.sdpa_backends() can force (best GQA mode each)."""
    import ablate_kernels as ak
    from ablate_kernels import tuning
    cuda, dtype = not ctx.dry, torch.bfloat16
    q = torch.randn(seqlen, heads, head_dim, device=ctx.device, dtype=dtype)         # (T, H, D)
    k, v = (torch.randn(seqlen, kv_heads, head_dim, device=ctx.device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, seqlen], device=ctx.device, dtype=torch.int32)
    warmup, repeats = (5, 20) if cuda else (0, 1)
    flops = 4 * heads * seqlen * seqlen * head_dim / 2              # causal: half of QK^T and PV
    flash_ms = median_ms(lambda: ak.flash_attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=True),
                         warmup, repeats, cuda)
    row = {"seqlen": seqlen, "head_dim": head_dim, "flash_tflops": flops / flash_ms / 1e9}
    row["autotuned_config"] = tuning.last_prefill_config()     # the prefill autotuner's pick
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))   # (1, heads, T, D)
    modes = (("gqa", ks, vs, True), ("repeat_kv", ks.repeat_interleave(heads // kv_heads, 1),
                                     vs.repeat_interleave(heads // kv_heads, 1), False))
    for label, backend in kg.sdpa_backends():
        best = math.inf
        for _, kk, vv, gqa in modes:
            def call(kk=kk, vv=vv, gqa=gqa):
                with backend():
                    return F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, enable_gqa=gqa)
            try:
                best = min(best, median_ms(call, warmup, repeats, cuda))
            except (RuntimeError, ValueError, NotImplementedError):   # backend unsupported here
                continue
        if best < math.inf:
            row[f"sdpa_{label}_tflops"] = flops / best / 1e9
            row[f"speedup_vs_sdpa_{label}"] = best / flash_ms
    return row


def kernel_timing(ctx) -> dict:
    import kernels_gpu as kg
    heads, kv_heads = (4, 2) if ctx.dry else (kg.NUM_HEADS, kg.NUM_KV_HEADS)
    shapes = [(64, 64)] if ctx.dry else [(t, d) for d in (64, 128) for t in (4096, 8192, 16384)]
    r = {"prefill": [], "prefill_note": f"causal bf16, H={heads} H_kv={kv_heads}; speedup = sdpa_ms / flash_ms "
                                       "(> 1: flash faster)"}
    for t, d in shapes:
        if ctx.remaining() <= 0:
            return r | {**_kernel_info(ctx.device), "status": "partial" if r["prefill"] else "failed",
                        "headline": f"cut short at the deadline: {len(r['prefill'])}/{len(shapes)} prefill shapes"}
        r["prefill"].append(_prefill_row(kg, t, d, heads, kv_heads, ctx))
        ctx.progress(r)
    prefill = r["prefill"]
    r |= _kernel_info(ctx.device)
    if ctx.dry:
        r["decode"] = "skipped: needs CUDA (kernels_gpu.bench_decode times with CUDA events)"
        r["headline"] = "dry run: prefill code path exercised on tiny shapes; timings not meaningful"
        return r
    torch.cuda.empty_cache()
    if ctx.remaining() <= 0:
        return r | {"status": "partial", "headline": "cut short at the deadline: prefill timed, paged decode not"}
    r["decode"] = [{k: v for k, v in row.items() if k != "sweep"}
                   for row in kg.bench_decode(SimpleNamespace(warmup=5, repeats=20, sweep=False, configs=False))]
    torch.cuda.empty_cache()        # for the CLI runs that follow, in their own processes
    last = prefill[-1]
    paged = next((row for row in r["decode"] if row.get("bench") == "paged_decode"), {})
    vs = {k.removeprefix("speedup_vs_sdpa_"): round(v, 2) for k, v in last.items() if k.startswith("speedup_vs")}
    r["headline"] = (f"prefill T={last['seqlen']} d{last['head_dim']}: flash {last['flash_tflops']:.0f} TFLOP/s, "
                     f"speedup vs SDPA {vs}; paged decode vs SDPA {paged.get('speedup', float('nan')):.2f}x")
    return r


MIN_CLI_S = 20     # a CLI run given less than this before the deadline cannot load a model: not started


# tests that need CUDA (graph capture under sync-debug mode, the kernels' launchers), which no CPU run of
# the suite reaches, with the graph-replay and host-sync tests beside them
GPU_TESTS = ("kernels/tests/test_runtime.py", "tests/test_graphs.py", "tests/test_host_syncs.py")
GPU_TESTS_S = 240


def gpu_tests(ctx) -> dict:
    """pytest over GPU_TESTS (not slow): counts from its JUnit XML; on a GPU a CUDA-only test that skipped
    makes the section partial."""
    import importlib.util
    import xml.etree.ElementTree as ET
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "headline": "pytest is not installed here: carry its wheels (pytest, pluggy, "
                                                 "iniconfig) with the others"}
    xml = ctx.out / "logs" / "gpu_tests.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    files = GPU_TESTS[:1] if ctx.dry else GPU_TESTS     # a dry run: the section's mechanics (CI runs the rest)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", f"--junitxml={xml}",
           *files]
    try:
        proc = ctx.run_process(cmd, GPU_TESTS_S, cwd=REPO, env=ctx.child_env(), capture_output=True, text=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    except subprocess.TimeoutExpired:
        tail = f"timed out after {min(GPU_TESTS_S, ctx.remaining()):.0f} s"
    (ctx.out / "logs" / "gpu_tests.log").write_text(tail)
    if not xml.exists():
        return {"status": "failed", "headline": f"pytest wrote no report: {tail.splitlines()[-1] if tail else ''}"}
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    outcome = {"passed": 0, "failed": 0, "skipped": 0}
    cuda_skipped = []
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome["failed" if kind in ("failure", "error") else kind] += 1
        if kind == "skipped" and "CUDA" in (case.find("skipped").get("message") or ""):
            cuda_skipped.append(case.get("name"))
    status = ("failed" if outcome["failed"] or not cases else
              "partial" if cuda_skipped and not ctx.dry else "ok")
    return {**outcome, "cuda_only_skipped": cuda_skipped, "status": status,
            "headline": f"{outcome['passed']} passed, {outcome['failed']} failed, {outcome['skipped']} skipped"
                        + (f" ({len(cuda_skipped)} CUDA-only skipped{': a dry run' if ctx.dry else ''})"
                           if cuda_skipped else "")}


def run_cli(ctx, name: str, overrides: list[str], timeout: float) -> dict:
    """`python -m ablate` in a subprocess, for at most `timeout` s and never past the deadline; its
    summary.csv read back (None when the run wrote none) and each arm's state (`arm_states`)."""
    import pandas as pd
    model = (["model=tiny", "model.init=random", "device=cpu", "threads=1"] if ctx.dry else
             ["model=llama-3.2-1b", "model.init=random", "model.dtype=bf16", "device=cuda"])
    peaks = (["peak_bandwidth=1e10", "peak_flops=1e11"] if ctx.dry else
             [f"peak_bandwidth={ctx.measured['copy_bytes_s']:.4g}", f"peak_flops={ctx.measured['matmul_flops']:.4g}"]
             if "matmul_flops" in ctx.measured else [])
    cmd = [sys.executable, "-m", "ablate", *overrides, *model, "workload.source=random", *peaks, "redo=true",
           "wandb.mode=disabled", f"results_dir={ctx.out / 'runs'}", f"hydra.run.dir={ctx.out / 'hydra' / name}"]
    if ctx.remaining() < MIN_CLI_S:
        return {"rc": "not started", "wall_s": 0.0, "log": None, "run_dir": None, "summary": None, "arms": [],
                "error_tail": f"not started: {max(ctx.remaining(), 0):.0f} s left before the deadline"}
    log = ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started, limit = time.monotonic(), min(timeout, ctx.remaining())
    try:
        proc = ctx.run_process(cmd, timeout, cwd=REPO, env=ctx.child_env(), capture_output=True, text=True)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = ("timeout", _text(exc.stdout),
                              _text(exc.stderr) + f"\ntimed out after {limit:.0f} s (its own {timeout:.0f} s or the deadline)")
    log.write_text(f"$ {' '.join(cmd)}\n\n{stdout}\n--- stderr ---\n{stderr}")
    found = re.findall(r"^results: (.+)$", f"{stdout}\n{stderr}", flags=re.M)
    run_dir = Path(found[-1].strip()) if found else None
    run = {"rc": rc, "wall_s": round(time.monotonic() - started, 1), "log": str(log),
           "run_dir": str(run_dir) if run_dir else None}
    read = lambda file: pd.read_csv(run_dir / file) if run_dir and (run_dir / file).exists() else None  # noqa: E731
    run["summary"] = read("summary.csv")
    run["arms"] = arm_states(run["summary"], read("runs.csv"))
    if rc != 0 or run["summary"] is None:
        run["error_tail"] = "\n".join((stderr or stdout).strip().splitlines()[-8:])
    return run


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def arm_states(summary, runs) -> list[dict]:
    """Each arm's status (summary.csv: ok, noisy, degraded, diverged, failed, skipped) and how its decode
    steps ran (runs.csv's engine.graphs: eager, compile, cuda-graphs, or "eager (why)" when an arm that
    asked for CUDA graphs could not use them; ablate/engine/graphs.py), with its graph replays."""
    if summary is None:
        return []
    arms = []
    for row in summary.itertuples():
        state = {"arm": row.arm, "status": getattr(row, "status", "ok")}
        if isinstance(getattr(row, "status_detail", None), str):
            state["detail"] = row.status_detail
        if runs is not None and "engine.graphs" in runs:
            rounds = runs[runs["arm"] == row.arm]
            modes = rounds["engine.graphs"].dropna()
            if len(modes):
                state["decode"] = str(modes.iloc[-1])
                if "engine.graph_replays" in rounds:
                    state["graph_replays"] = int(rounds["engine.graph_replays"].fillna(0).sum())
        arms.append(state)
    return arms


UNMEASURED = ("failed", "diverged", "skipped")     # the arm's figures are missing or wrong


def arm_problems(arms: list[dict]) -> list[str]:
    """What makes a run's arms not ok: an arm that failed, diverged from the baseline or was skipped; one
    that asked for CUDA graphs and ran eagerly ("eager (capture failed: ...)"), or captured and never
    replayed. Contended (noisy) and lossy (degraded) arms are measured as they claim, and say so."""
    problems = []
    for arm in arms:
        if arm["status"] in UNMEASURED:
            problems.append(f"{arm['arm']} {arm['status']}" + (f" ({arm['detail']})" if arm.get("detail") else ""))
        decode = arm.get("decode", "")
        if decode.startswith("eager ("):
            problems.append(f"{arm['arm']} ran eagerly: {decode}")
        elif decode == "cuda-graphs" and arm.get("graph_replays") == 0:
            problems.append(f"{arm['arm']} captured CUDA graphs but never replayed one")
    return problems


def arms_line(arms: list[dict]) -> str:
    """Each arm's status and decode mode, arms alike grouped: "ok/cuda-graphs: graphs; ok/eager: eager"."""
    groups: dict[str, list[str]] = {}
    for arm in arms:
        key = f"{arm['status']}/{arm.get('decode', '?')}"
        if arm.get("decode") == "cuda-graphs" and "graph_replays" in arm:
            key += f" ({arm['graph_replays']} replays)"
        groups.setdefault(key, []).append(arm["arm"])
    return "; ".join(f"{key}: {', '.join(names)}" for key, names in groups.items())


def _speedups(summary) -> list[dict]:
    cols = [c for c in ("prompt_len", "output_len", "arm", "status", "speedup", "speedup_ci_low", "speedup_ci_high",
                        "time_ratio", "tpot_p50_ms", "ttft_p50_ms") if c in summary.columns]
    return summary[cols].round(4).to_dict("records")


EXPERIMENTS = {   # name: (overrides on a GPU, on the dry run)
    "ch08_kv_cache": (["experiment.grid.output_len=[32,128]"], ["experiment.grid.output_len=[8]"]),
    "ch12_flash": (["experiment.grid.prompt_len=[1024,4096,8192]", "model.max_seq_len=8193",    # its full size
                    "engine.max_num_batched_tokens=8192"], ["experiment.grid.prompt_len=[64]"]),
    "ablation": (["workload.num_requests=4"], ["workload.num_requests=2", "workload.output_len=4"]),
}


def experiments(ctx) -> dict:
    r, failed, problems = {}, [], []
    for name, (gpu, dry) in EXPERIMENTS.items():
        run = run_cli(ctx, name, [f"+experiment={name}", "experiment.repeats=3", *(dry if ctx.dry else gpu)],
                      timeout=120 if ctx.dry else 150)
        summary = run.pop("summary")
        if summary is None or run["rc"] != 0:
            failed.append(name)
        else:
            run["speedups"] = _speedups(summary)
        problems += [f"{name}: {p}" for p in arm_problems(run["arms"])]
        r[name] = run
        ctx.progress(r)
    r["problems"] = problems
    r["status"] = "failed" if len(failed) == len(EXPERIMENTS) else "partial" if failed or problems else "ok"
    r["headline"] = " | ".join(
        f"{n} {r[n]['wall_s']:.0f} s" + (f" FAILED (rc {r[n]['rc']})" if n in failed else "")
        + (f": {arms_line(r[n]['arms'])}" if r[n]["arms"] else "") for n in EXPERIMENTS)
    if problems:
        r["headline"] += " | not ok: " + "; ".join(problems)
    return r


GRAPH_ARMS = ("{eager: {kv_cache: contiguous, attention: flash}, "
              "graphs: {kv_cache: contiguous, attention: flash, engine: {graphs: true}}}")
EAGER_ONLY = "{eager: {kv_cache: contiguous, attention: flash}}"


def decode_mbu(ctx) -> dict:
    """MBU = (weight bytes + KV bytes read) per decode step / TPOT p50 / the measured copy bandwidth."""
    from ablate.model.presets import preset
    cfg = preset("tiny" if ctx.dry else "llama-3.2-1b", dtype="fp32" if ctx.dry else "bf16")
    # a decode step reads every weight once (the LM head, not the embedding table: only B rows of it)
    weight_bytes = (cfg.num_params(include_embeddings=False) + cfg.vocab_size * cfg.d_model) * cfg.torch_dtype.itemsize
    prompt_len, output_len = 128, (8 if ctx.dry else 128)
    bandwidth = ctx.measured.get("copy_bytes_s")
    r, rows, problems = {"weight_bytes": weight_bytes, "kv_bytes_per_token": cfg.kv_bytes_per_token(),
                         "copy_gb_s": bandwidth and bandwidth / 1e9}, [], []
    for batch in (1, 2) if ctx.dry else (1, 16):
        common = [f"experiment.name=gpu_check_mbu_b{batch}", f"workload.num_requests={batch}", "experiment.repeats=3",
                  f"engine.max_num_seqs={batch}", f"workload.prompt_len={prompt_len}", "experiment.warmup=1",
                  f"workload.output_len={output_len}", "experiment.quality.enabled=false"]
        run = run_cli(ctx, f"mbu_b{batch}", [f"++experiment.arms={GRAPH_ARMS}", *common], timeout=120)
        if run["summary"] is None:  # e.g. the per-arm engine option is refused: eager alone still measures
            r[f"graphs_b{batch}_error"] = run.get("error_tail", "")
            problems.append(f"B={batch}: the eager+graphs run failed (rc {run['rc']}); eager alone")
            run = run_cli(ctx, f"mbu_b{batch}_eager", [f"++experiment.arms={EAGER_ONLY}", *common], timeout=120)
        if run["summary"] is None:
            problems.append(f"B={batch}: no summary (rc {run['rc']}): {run.get('error_tail', '')[-300:]}")
            rows.append({"batch": batch, "rc": run["rc"], "log": run["log"]})
            ctx.progress({**r, "batches": rows})
            continue
        problems += [f"B={batch}: {p}" for p in arm_problems(run["arms"])]
        # a decode step at batch B reads the weights once and each sequence's context (mean: prompt + output / 2)
        step_bytes = weight_bytes + batch * (prompt_len + output_len / 2) * cfg.kv_bytes_per_token()
        row = {"batch": batch, "wall_s": run["wall_s"], "log": run["log"], "step_bytes": step_bytes,
               "arms": arms_line(run["arms"])}
        for arm in run["summary"].itertuples():
            row[f"tpot_p50_ms_{arm.arm}"] = arm.tpot_p50_ms
            row[f"mbu_{arm.arm}"] = step_bytes / (arm.tpot_p50_ms / 1e3) / bandwidth if bandwidth else None
            row[f"ablate_mbu_decode_{arm.arm}"] = getattr(arm, "mbu_decode", None)
        if "tpot_p50_ms_graphs" in row:
            row["graphs_speedup"] = row["tpot_p50_ms_eager"] / row["tpot_p50_ms_graphs"]
        rows.append(row)
        ctx.progress({**r, "batches": rows})
    r["batches"], r["problems"] = rows, problems
    measured = [row for row in rows if "arms" in row]
    r["status"] = "failed" if not measured else "partial" if problems else "ok"
    r["headline"] = "; ".join(
        f"B={row['batch']}: MBU eager {row.get('mbu_eager') or float('nan'):.1%}, graphs "
        f"{row.get('mbu_graphs') or float('nan'):.1%}, graphs/eager {row.get('graphs_speedup', float('nan')):.2f}x "
        f"[{row['arms']}]" for row in measured) + (" | not ok: " + "; ".join(problems) if problems else "")
    return r
