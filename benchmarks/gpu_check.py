"""Check a GPU machine in one command (< 8 min on one H200): what it is, whether the kernels are right,
how fast they are, and the CLI's experiments end to end.

    python benchmarks/gpu_check.py [--out gpu_check_out] [--dry-run] [--budget-s 470]

Sections, in this order (the one whose figures matter most right after the ceilings it needs):
  preflight           every import the CLI and this check need (ablate.preflight): a missing package named
                      in seconds, and nothing else run
  environment         GPU, driver, versions, TF32 flags; measured copy bandwidth and bf16 matmul TFLOP/s
  decode_mbu          decode MBU of eager vs CUDA-graph decode steps at batch 1 and 16
  kernel_correctness  the Triton kernels against the fp32 references: head dims 64/128/256, GQA groups
                      1/3/4/9, ragged batches, bf16 and fp16
  gpu_tests           pytest over the tests that need CUDA (graph capture with host syncs made errors, the
                      kernels' launchers) and the graph-replay and host-sync tests (needs pytest's wheels)
  kernel_timing       flash prefill vs each SDPA backend (4k/8k/16k, d64/d128, causal bf16, TFLOP/s) and
                      paged decode vs SDPA over the same tokens (benchmarks/kernels_gpu.py's functions)
  experiments         ch08_kv_cache, ch12_flash and a 4-request ablation through `python -m ablate`
(benchmarks/gpu_check_sections.py). A section whose CLI runs failed, or whose arms failed, diverged or
ran eagerly where they asked for CUDA graphs, is `partial` or `failed`, its headline naming each arm's
status and how its decode steps ran.

The budget is a hard deadline: the sections run in a worker process (its own process group, dying with
this one), which gets SIGTERM 3 s before the deadline and SIGKILL at it, with every process it started.
Each section saves its results so far as it goes (OUT/sections/NAME.json), and gpu_check.json and
gpu_check.md are rewritten from those within half a second, atomically: killed at any moment, they hold
everything finished, and a section cut short is `partial` with what it got. The CLI runs and their
logs go under OUT/runs and OUT/logs. --dry-run (and any machine without CUDA) runs the same code on the
CPU, the kernels under Triton's interpreter, with tiny shapes.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("preflight", "environment", "decode_mbu", "kernel_correctness", "gpu_tests", "kernel_timing", "experiments")
TERM_GRACE_S = 3.0      # the worker's group gets SIGTERM this long before the deadline, SIGKILL at it
POLL_S = 0.5            # how often the supervisor copies the sections' progress into gpu_check.json
PR_SET_PDEATHSIG = 1    # prctl(2): the signal a process gets when its parent dies (Linux)
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl    # looked up before any fork: preexec_fn only calls it
except (OSError, AttributeError):                       # not Linux: a killed supervisor can orphan its worker
    _prctl = None


def die_with_parent() -> None:
    """In a child between fork and exec: SIGKILL it when its parent dies, so that a SIGKILLed
    gpu_check (which cannot clean up) still leaves no process behind."""
    parent = os.getppid()
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:      # the parent died before the prctl: nobody would kill us
            os._exit(1)


def _new_group_dying_with_parent() -> None:
    os.setpgid(0, 0)                    # one group: the worker and every process it starts, killed as one
    die_with_parent()


# A SIGKILLed supervisor runs no code: this process, its child outside the worker's group, gets SIGTERM
# when it dies (PR_SET_PDEATHSIG) and kills the whole group, also what a section started on its own.
GROUP_REAPER = ("import os, signal, sys\n"
                "def reap(*_):\n"
                "    try: os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
                "    except ProcessLookupError: pass\n"
                "    os._exit(0)\n"
                "signal.signal(signal.SIGTERM, reap)\n"
                "if os.getppid() != int(sys.argv[2]): reap()\n"
                "while True: signal.pause()\n")


def _terminate_with_parent() -> None:
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_group_reaper(pgid: int) -> subprocess.Popen | None:
    """The process that kills group `pgid` when this one dies of a signal it cannot catch (Linux only)."""
    if _prctl is None:
        return None
    return subprocess.Popen([sys.executable, "-S", "-c", GROUP_REAPER, str(pgid), str(os.getpid())],
                            preexec_fn=_terminate_with_parent)


def section_path(out: Path, name: str) -> Path:
    return out / "sections" / f"{name}.json"


@dataclass
class Context:
    """What the sections share (in the worker): where to write, CPU dry run or GPU, the deadline, and
    what earlier sections measured."""
    out: Path
    dry: bool
    deadline: float                                # time.time() at which the supervisor kills the worker
    started: float = field(default_factory=time.time)
    measured: dict = field(default_factory=dict)   # e.g. copy_bytes_s, matmul_flops (environment)
    section: str = ""                              # the section running, since section_started
    section_started: float = 0.0

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def remaining(self) -> float:
        """Seconds until the worker is told to stop: what a section, or a process it starts, may still use."""
        return self.deadline - TERM_GRACE_S - time.time()

    def progress(self, result: dict) -> None:
        """Save a section's results so far: if it is cut short, this is what it got; its end replaces it."""
        write_json(section_path(self.out, self.section),
                   {"status": "running", "headline": "", "result": dict(result), "started_at": self.section_started,
                    "seconds": time.time() - self.section_started})

    def child_env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.dry:    # the CLI on the CPU runs as a user's would: SDPA where Triton cannot compile
            env.pop("TRITON_INTERPRET", None)
        return env

    def run_process(self, cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run for at most `timeout` s and never past the deadline (TimeoutExpired, as
        subprocess.run raises it); the process dies with this one, and stays in its process group so
        that the supervisor's kill at the deadline reaches it."""
        return subprocess.run(cmd, timeout=max(min(timeout, self.remaining()), 0.1), preexec_fn=die_with_parent,
                              **kwargs)


def write_json(path: Path, value: dict) -> None:
    write_text(path, json.dumps(value, indent=2, default=str))


def write_text(path: Path, text: str) -> None:
    """Atomically: a reader (or a kill) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# gpu_check ({'dry run, CPU' if meta.get('dry_run') else 'CUDA'})", "",
             f"started {meta['started']}, total {meta.get('total_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget",
             "", summary_table(report), ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']:.1f} s)", "", sec.get("headline", ""), ""]
        lines += markdown_lines(sec.get("result", {}))
        if sec.get("error"):
            lines += ["```", sec["error"].rstrip(), "```", ""]
    return "\n".join(lines)


def summary_table(report: dict) -> str:
    rows = [f"{'section':<20}{'status':<10}{'s':>7}  headline", "-" * 78]
    for name, sec in report["sections"].items():
        rows.append(f"{name:<20}{sec['status']:<10}{sec['seconds']:>7.1f}  {sec.get('headline', '')[:400]}")
    return "```\n" + "\n".join(rows) + "\n```"


# ---- the worker: runs the sections in order, each writing OUT/sections/NAME.json


def run_section(name: str, fn, ctx: Context) -> dict:
    """Run one section and save its outcome (result, or error and traceback, with what it had saved so
    far). An interrupt (the supervisor's SIGTERM) propagates, leaving its progress for the supervisor."""
    print(f"== {name} ({ctx.remaining():.0f} s left)", flush=True)
    ctx.section, ctx.section_started = name, time.time()
    if ctx.remaining() <= 0:
        sec = {"status": "skipped", "headline": "skipped: the deadline is reached"}
    else:
        try:
            result = fn(ctx)
            sec = {"status": result.pop("status", "ok"), "headline": result.pop("headline", ""), "result": result}
        except Exception as exc:        # noqa: BLE001  (recorded; the next section still runs)
            partial = (read_json(section_path(ctx.out, name)) or {}).get("result")     # saved by ctx.progress
            sec = {"status": "failed", "headline": f"{type(exc).__name__}: {exc}"[:300],
                   "error": traceback.format_exc(), **({"result": partial} if partial else {})}
            print(sec["error"], file=sys.stderr, flush=True)
    sec["seconds"] = time.time() - ctx.section_started
    write_json(section_path(ctx.out, name), sec)
    print(f"   {sec['status']} in {sec['seconds']:.1f} s: {sec['headline']}", flush=True)
    return sec


def preflight(ctx: Context) -> dict:
    """Every import the CLI and this check need (ablate.preflight), each missing one named with its pip name."""
    from ablate import preflight as check    # ablate/__init__.py imports nothing else: this works when torch is missing
    problems = check.missing(check.REQUIRED)
    optional = check.missing(check.OPTIONAL, load=False)
    r = {"python": sys.executable, "missing": problems, "optional_missing": optional}
    if problems:
        return r | {"status": "failed", "headline": "; ".join(problems)}
    return r | {"headline": f"all {len(check.REQUIRED)} required imports work"
                            + (f"; optional missing: {', '.join(line.split()[1] for line in optional)}" if optional else "")}


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@functools.cache
def load_sections(path: Path):
    """benchmarks/gpu_check_sections.py (or a test's fake), imported only after the preflight and
    TRITON_INTERPRET are settled; kernels_gpu beside it stays importable."""
    spec = importlib.util.spec_from_file_location("gpu_check_sections", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).parent))
    spec.loader.exec_module(module)
    return module


def work(args) -> int:
    """The worker's main: settle the device, then run the sections; stop after a failed preflight."""
    signal.signal(signal.SIGTERM, _terminated)      # the supervisor's stop: leave the progress as it is
    try:
        import torch        # torch does not import triton: TRITON_INTERPRET can still be settled after this
        cuda = torch.cuda.is_available()
    except ImportError:     # the preflight names it
        cuda = False
    dry = args.dry_run or not cuda
    if dry:                 # the interpreter must be switched on before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    ctx = Context(args.out.resolve(), dry, args.worker_deadline)
    write_json(ctx.out / "sections" / "device.json", {"dry_run": dry, "device": ctx.device})
    try:
        for name in args.only or SECTIONS:
            fn = preflight if name == "preflight" else (
                lambda ctx, name=name: getattr(load_sections(args.sections_from), name)(ctx))
            if run_section(name, fn, ctx)["status"] == "failed" and name == "preflight":
                return 1
    except KeyboardInterrupt:
        return 1
    return 0


# ---- the supervisor: starts the worker, enforces the deadline, and assembles the report


def assemble(out: Path, names: list[str], meta: dict) -> dict:
    """The report as the sections' files have it now (a section not started yet is left out)."""
    found = {name: read_json(section_path(out, name)) for name in names}
    device = read_json(out / "sections" / "device.json") or {}
    return {"meta": meta | device | {"total_s": time.time() - meta["started_at"]},
            "sections": {name: sec for name, sec in found.items() if sec is not None}}


def finish(report: dict, names: list[str], why: str) -> dict:
    """The report once the worker is gone: a section it left running is `partial` with the results it
    had saved (`failed` without any), one it never started `skipped`, each saying `why`."""
    sections = report["sections"]
    for name, sec in sections.items():
        if sec["status"] == "running":
            sec["seconds"] = time.time() - sec.pop("started_at", time.time() - sec["seconds"])
            got = bool(sec.get("result"))
            sec["status"] = "partial" if got else "failed"
            sec["headline"] = f"cut short ({why}) after {sec['seconds']:.0f} s: " + (
                "the results saved so far" if got else "nothing saved")
    preflight_failed = sections.get("preflight", {}).get("status") == "failed"
    for name in names:
        if name not in sections:
            sections[name] = {"status": "skipped", "seconds": 0.0,
                              "headline": "skipped: the preflight failed" if preflight_failed else f"skipped: {why}"}
    report["sections"] = {name: sections[name] for name in names}
    return report


def publish(out: Path, report: dict) -> None:
    write_json(out / "gpu_check.json", report)
    write_text(out / "gpu_check.md", markdown(report))


def stop_group(worker: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the worker's process group, then SIGKILL whatever is left of it after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0)):
        try:
            os.killpg(worker.pid, sig)
        except ProcessLookupError:
            return
        end = time.time() + wait
        while time.time() < end:
            worker.poll()       # reaped, the worker's zombie no longer keeps its group alive
            try:
                os.killpg(worker.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def supervise(args, names: list[str], budget_s: float) -> dict:
    out = args.out.resolve()
    started = time.time()
    deadline = started + budget_s
    meta = {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "started_at": started,
            "budget_s": budget_s, "dry_run": args.dry_run}
    for stale in (out / "sections").glob("*.json"):     # a previous run's sections must not pass for this one's
        stale.unlink()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--worker-deadline", repr(deadline),
           "--sections-from", str(args.sections_from), "--only", *names, *(["--dry-run"] if args.dry_run else [])]
    worker = subprocess.Popen(cmd, cwd=REPO, preexec_fn=_new_group_dying_with_parent)
    reaper = start_group_reaper(worker.pid)
    why, last = "the worker ended", None
    try:
        while worker.poll() is None:
            now = time.time()
            if now >= deadline - TERM_GRACE_S:
                why = f"the {budget_s:.0f} s deadline"
                stop_group(worker, max(deadline - now, 0))
                break
            report = assemble(out, names, meta)
            if report["sections"] != last:
                publish(out, report)
                last = report["sections"]
            time.sleep(POLL_S)
        else:
            if worker.returncode != 0:
                why = f"the worker ended with exit status {worker.returncode}"
    except KeyboardInterrupt as exc:
        why = f"interrupted ({exc or 'Ctrl-C'})"
        stop_group(worker, TERM_GRACE_S)
    stop_group(worker, 0)           # anything the worker left behind in its group
    worker.wait()
    if reaper is not None:
        reaper.kill()
        reaper.wait()
    report = finish(assemble(out, names, meta), names, why)
    publish(out, report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for gpu_check.json/.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on the CPU (Triton interpreter, tiny shapes): a test of this script")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="hard deadline for the whole check, in seconds (default 470, 280 with --dry-run)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--worker-deadline", type=float, help=argparse.SUPPRESS)    # set: this is the worker
    parser.add_argument("--sections-from", type=Path, default=Path(__file__).resolve().with_name(
        "gpu_check_sections.py"), help=argparse.SUPPRESS)                         # tests give fake sections
    args = parser.parse_args(argv)
    if args.worker_deadline is not None:
        return work(args)
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)
    signal.signal(signal.SIGTERM, _terminated)    # `timeout`: stop the worker, record what it got, then exit
    args.out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget_s or (280 if args.dry_run else 470)
    names = [name for name in SECTIONS if name in (args.only or SECTIONS)]   # --only keeps this order
    report = supervise(args, names, budget_s)
    print("\n" + summary_table(report).strip("`\n"), flush=True)
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'} "
          f"({report['meta']['total_s']:.0f} s)", flush=True)
    return 0 if all(s["status"] in ("ok", "partial") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
