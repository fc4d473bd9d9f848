"""Check a GPU machine in one command (< 8 min on one H200): what it is, whether the kernels are right,
how fast they are, and the CLI's experiments end to end.

    python benchmarks/gpu_check.py [--out gpu_check_out] [--dry-run] [--budget-s 470]

Sections (benchmarks/gpu_check_sections.py), each recorded on its own, a failure with its traceback:
  environment         GPU, driver, versions, TF32 flags; measured copy bandwidth and bf16 matmul TFLOP/s
  kernel_correctness  the Triton kernels against the fp32 references: head dims 64/128/256, GQA groups
                      1/3/4/9, ragged batches, bf16 and fp16
  kernel_timing       flash prefill vs each SDPA backend (4k/8k/16k, d64/d128, causal bf16, TFLOP/s) and
                      paged decode vs SDPA over the same tokens (benchmarks/kernels_gpu.py's functions)
  experiments         ch08_kv_cache, ch12_flash and a 4-request ablation through `python -m ablate`
  decode_mbu          decode MBU of eager vs CUDA-graph decode steps at batch 1 and 16
gpu_check.json is rewritten after every section (a timeout keeps what was done), gpu_check.md at the
end of each too; the CLI runs and their logs go under OUT/runs and OUT/logs. --dry-run (and any machine
without CUDA) runs the same code on the CPU, the kernels under Triton's interpreter, with tiny shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "kernel_correctness", "kernel_timing", "experiments", "decode_mbu")


@dataclass
class Context:
    """What the sections share: where to write, CPU dry run or GPU, and what earlier sections measured."""
    out: Path
    dry: bool
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    measured: dict = field(default_factory=dict)   # e.g. copy_bytes_s, matmul_flops (environment)
    report: dict = field(default_factory=dict)     # what gpu_check.json holds
    section: str = ""                              # the section running, since section_started
    section_started: float = 0.0

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def progress(self, result: dict) -> None:
        """Save a section's results so far (a timeout mid-section keeps them); its final record replaces them."""
        if self.report:
            self.report["sections"][self.section] = {
                "status": "incomplete", "headline": "cut short: the results so far", "result": dict(result),
                "seconds": time.monotonic() - self.section_started}
            write_json(self.out / "gpu_check.json", self.report)

    def child_env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.dry:    # the CLI on the CPU runs as a user's would: SDPA where Triton cannot compile
            env.pop("TRITON_INTERPRET", None)
        return env


def write_json(path: Path, report: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "/").replace("\n", " ")


def markdown_lines(value, title: str = "") -> list[str]:
    """Scalars as one key | value table, a list of dicts as a table, a dict's dicts and lists under their keys."""
    head = [f"**{title}**", ""] if title else []
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        cols = list(dict.fromkeys(k for row in value for k in row))
        rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return head + rows + ["| " + " | ".join(_cell(row.get(c, "")) for c in cols) + " |" for row in value] + [""]
    if not isinstance(value, dict):
        text = value if isinstance(value, str) and "\n" not in value else json.dumps(value, indent=2, default=str)
        return head + ([text] if "\n" not in text else ["```", text, "```"]) + [""]
    scalars = {k: v for k, v in value.items() if not isinstance(v, (dict, list)) and k != "error_tail"}
    lines = head + (["| key | value |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in scalars.items()), ""]
                    if scalars else [])
    for key, sub in value.items():
        if key == "error_tail":
            lines += [f"**{title} {key}**".replace("** ", "**"), "", "```", str(sub), "```", ""]
        elif isinstance(sub, (dict, list)):
            lines += markdown_lines(sub, f"{title} {key}".strip())
    return lines


def write_markdown(path: Path, report: dict) -> None:
    meta = report["meta"]
    lines = [f"# gpu_check ({'dry run, CPU' if meta['dry_run'] else 'CUDA'})", "",
             f"started {meta['started']}, total {meta.get('total_s', 0):.0f} s", "", summary_table(report), ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']:.1f} s)", "", sec.get("headline", ""), ""]
        lines += markdown_lines(sec.get("result", {}))
        if sec.get("error"):
            lines += ["```", sec["error"].rstrip(), "```", ""]
    path.write_text("\n".join(lines))


def summary_table(report: dict) -> str:
    rows = [f"{'section':<20}{'status':<10}{'s':>7}  headline", "-" * 78]
    for name, sec in report["sections"].items():
        rows.append(f"{name:<20}{sec['status']:<10}{sec['seconds']:>7.1f}  {sec.get('headline', '')[:200]}")
    return "```\n" + "\n".join(rows) + "\n```"


def run_section(name: str, fn, ctx: Context, report: dict) -> None:
    """Run one section; its outcome (result, or error and traceback) goes into the report, then to disk."""
    print(f"== {name} ({ctx.remaining():.0f} s of budget left)", flush=True)
    ctx.report, ctx.section, ctx.section_started = report, name, time.monotonic()
    interrupted = None
    if ctx.remaining() <= 0:
        sec = {"status": "skipped", "headline": f"skipped: time budget ({ctx.budget_s:.0f} s) spent"}
    else:
        try:
            result = fn(ctx)
            sec = {"status": result.pop("status", "ok"), "headline": result.pop("headline", ""), "result": result}
        except BaseException as exc:    # noqa: BLE001 (an interrupt too: record it, then stop)
            partial = report["sections"].get(name, {}).get("result")      # saved by ctx.progress
            sec = {"status": "failed", "headline": f"{type(exc).__name__}: {exc}"[:300],
                   "error": traceback.format_exc(), **({"result": partial} if partial else {})}
            interrupted = None if isinstance(exc, Exception) else exc
            print(sec["error"], file=sys.stderr, flush=True)
    sec["seconds"] = time.monotonic() - ctx.section_started
    report["sections"][name] = sec
    report["meta"]["total_s"] = time.monotonic() - ctx.started
    write_json(ctx.out / "gpu_check.json", report)
    write_markdown(ctx.out / "gpu_check.md", report)
    print(f"   {sec['status']} in {sec['seconds']:.1f} s: {sec['headline']}", flush=True)
    if interrupted is not None:
        raise interrupted


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for gpu_check.json/.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on the CPU (Triton interpreter, tiny shapes): a test of this script")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="sections that would start later than this are skipped (default 470 GPU, 280 dry)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    args = parser.parse_args(argv)

    # the interpreter must be switched on before triton is first imported (torch does not import it)
    if args.dry_run or not __import__("torch").cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        args.dry_run = True
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)
    signal.signal(signal.SIGTERM, _terminated)    # `timeout`: record the section cut short, then stop
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.out.resolve(), args.dry_run, args.budget_s or (280 if args.dry_run else 470))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_sections as sections   # after TRITON_INTERPRET is settled

    report = {"meta": {"dry_run": ctx.dry, "device": ctx.device, "argv": sys.argv,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": ctx.budget_s},
              "sections": {}}
    try:
        for name in args.only or SECTIONS:
            run_section(name, getattr(sections, name), ctx, report)
    except KeyboardInterrupt:
        print("\ninterrupted: the sections so far are in gpu_check.json", file=sys.stderr, flush=True)
    print("\n" + summary_table(report).strip("`\n"), flush=True)
    print(f"wrote {ctx.out / 'gpu_check.json'} and {ctx.out / 'gpu_check.md'}", flush=True)
    return 0 if all(s["status"] in ("ok", "partial") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
