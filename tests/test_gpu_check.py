"""benchmarks/gpu_check.py: its budget is a hard deadline (no section or process outlives it, a section
cut short keeps what it saved), decode_mbu runs first, the preflight names what is missing, a section
whose arms failed or ran eagerly is not ok, and its dry run (the same code on the CPU, the kernels
under Triton's interpreter, tiny shapes) passes every section that can pass without a GPU."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from ablate import preflight

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SECTIONS = ("preflight", "environment", "decode_mbu", "kernel_correctness", "gpu_tests", "kernel_timing",
            "experiments")


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def load_gpu_check():
    return load("gpu_check", SCRIPT)


def load_sections():
    return load("gpu_check_sections", REPO / "benchmarks" / "gpu_check_sections.py")


def is_gone(pid: int, within_s: float = 5.0) -> bool:
    """The process has exited (a zombie waiting for its new parent to reap it counts as exited)."""
    end = time.time() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        if time.time() > end:
            return False
        time.sleep(0.1)


# fake sections for the worker (--sections-from): a fast one that leaves a process running, a slow one
# that saves some results, then waits on a process that ignores every deadline, and one never reached
FAKE_SECTIONS = """
import os, subprocess, sys, time
SLEEP = [sys.executable, "-c", "import time; time.sleep(1000)"]

def environment(ctx):
    left = subprocess.Popen(SLEEP)
    (ctx.out / "left.pid").write_text(str(left.pid))
    return {"headline": "fake environment", "value": 1}

def decode_mbu(ctx):
    (ctx.out / "worker.pid").write_text(str(os.getpid()))
    ctx.progress({"batches": [{"batch": 1, "mbu_eager": 0.5}]})
    child = subprocess.Popen(SLEEP)
    (ctx.out / "child.pid").write_text(str(child.pid))
    child.wait()
    return {"headline": "never reached"}

def kernel_correctness(ctx):
    return {"headline": "never reached"}
"""


def fake_check(tmp_path: Path, budget_s: float) -> list[str]:
    (tmp_path / "fake_sections.py").write_text(FAKE_SECTIONS)
    return [sys.executable, str(SCRIPT), "--dry-run", "--budget-s", str(budget_s), "--out", str(tmp_path / "out"),
            "--sections-from", str(tmp_path / "fake_sections.py"),
            "--only", "kernel_correctness", "decode_mbu", "environment"]     # out of order on purpose


def test_decode_mbu_runs_right_after_the_preflight_and_the_ceilings_it_needs():
    assert load_gpu_check().SECTIONS[:3] == ("preflight", "environment", "decode_mbu")


@pytest.mark.slow      # runs to its 15 s budget; the deadline's cut in the default run: the two tests below
def test_the_budget_is_a_hard_deadline_for_sections_and_every_process_they_start(tmp_path):
    budget = 15.0
    started = time.time()
    run = subprocess.run(fake_check(tmp_path, budget), cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.time() - started
    assert elapsed < budget + 3, f"{elapsed:.1f} s for a {budget} s budget\n{run.stdout}\n{run.stderr}"
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["environment", "decode_mbu", "kernel_correctness"]   # --only keeps SECTIONS' order
    assert sections["environment"]["status"] == "ok"
    cut = sections["decode_mbu"]
    assert cut["status"] == "partial" and "deadline" in cut["headline"], cut
    assert cut["result"] == {"batches": [{"batch": 1, "mbu_eager": 0.5}]}          # what it saved before the cut
    assert cut["seconds"] > 1
    assert sections["kernel_correctness"]["status"] == "skipped"
    assert run.returncode == 1
    for name in ("left", "child", "worker"):      # left behind by a finished section, running, and the worker
        pid = int((tmp_path / "out" / f"{name}.pid").read_text())
        assert is_gone(pid), f"{name} process {pid} outlived gpu_check"
    assert "## decode_mbu: partial" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_killed_check_leaves_valid_json_of_everything_so_far_and_no_process(tmp_path):
    check = subprocess.Popen(fake_check(tmp_path, 120), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "out"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
            if report.get("sections", {}).get("decode_mbu", {}).get("result") and (out / "child.pid").exists():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the slow section's progress never reached gpu_check.json")
    finally:
        check.send_signal(signal.SIGKILL)       # no chance to clean up: the files must already be whole
        check.wait()
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["sections"]["environment"]["status"] == "ok"
    assert report["sections"]["decode_mbu"]["result"] == {"batches": [{"batch": 1, "mbu_eager": 0.5}]}
    for name in ("worker", "child"):            # the worker dies with gpu_check, its processes with it
        pid = int((out / f"{name}.pid").read_text())
        assert is_gone(pid), f"{name} process {pid} outlived a killed gpu_check"
    os.kill(int((out / "left.pid").read_text()), signal.SIGKILL)   # a stray of a finished section: ours to end


def test_a_process_a_section_starts_never_runs_past_the_deadline(tmp_path):
    gc = load_gpu_check()
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + gc.TERM_GRACE_S + 1.0)
    started = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        ctx.run_process([sys.executable, "-c", "import time; time.sleep(100)"], timeout=600)
    assert time.time() - started < 3


def test_a_cli_run_that_cannot_finish_before_the_deadline_is_not_started(tmp_path):
    gc, sections = load_gpu_check(), load_sections()
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + gc.TERM_GRACE_S + sections.MIN_CLI_S - 5)
    run = sections.run_cli(ctx, "late", ["+experiment=ch08_kv_cache"], timeout=120)
    assert run["rc"] == "not started" and "deadline" in run["error_tail"] and run["summary"] is None
    assert not (tmp_path / "logs").exists()


def test_the_preflight_names_a_missing_module_and_its_pip_name(tmp_path, monkeypatch):
    lines = preflight.missing({"no_such_module_for_ablate": ("no-such-package", "a test")})
    assert lines == ["missing: no_such_module_for_ablate (pip install no-such-package), needed by a test"]
    # present itself, but its own dependency is not (omegaconf without antlr4): the dependency is named
    (tmp_path / "needs_a_missing_dependency.py").write_text("import no_such_dependency_for_ablate\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [line] = preflight.missing({"needs_a_missing_dependency": ("needs-it", "a test")})
    assert line.startswith("missing: no_such_dependency_for_ablate (pip install no-such-dependency-for-ablate)")
    assert "needs_a_missing_dependency" in line
    assert preflight.missing({"json": ("json", "the standard library")}) == []


def test_a_failed_preflight_stops_the_check_and_names_the_package(tmp_path, monkeypatch):
    gc = load_gpu_check()
    monkeypatch.setitem(preflight.REQUIRED, "no_such_module_for_ablate", ("no-such-package", "a test"))
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + 60)
    sec = gc.run_section("preflight", gc.preflight, ctx)
    assert sec["status"] == "failed"
    assert "no_such_module_for_ablate" in sec["headline"] and "pip install no-such-package" in sec["headline"]
    meta = {"started": "now", "started_at": time.time(), "budget_s": 60}
    report = gc.finish(gc.assemble(tmp_path, list(SECTIONS), meta), list(SECTIONS), "the worker ended")
    assert {s["status"] for name, s in report["sections"].items() if name != "preflight"} == {"skipped"}
    assert report["sections"]["environment"]["headline"] == "skipped: the preflight failed"


def third_party_imports() -> dict[str, str]:
    """Every top-level module imported (anywhere in a file) by ablate, its kernels, its plugins and
    gpu_check, outside the standard library and the tests: module -> one file importing it."""
    files = [*(REPO / "ablate").rglob("*.py"), *(REPO / "kernels" / "ablate_kernels").rglob("*.py"),
             *(REPO / "plugins").glob("*/ablate_*/**/*.py"), SCRIPT, REPO / "benchmarks" / "gpu_check_sections.py",
             REPO / "benchmarks" / "kernels_gpu.py"]
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return {m: f for m, f in found.items() if m not in sys.stdlib_module_names}


def test_every_import_of_the_cli_and_gpu_check_is_in_the_preflight():
    listed = {name.split(".")[0] for name in preflight.REQUIRED | preflight.OPTIONAL}
    first_party = {"ablate", "gpu_check_sections", "kernels_gpu"}
    test_only = {"pytest", "hypothesis"}      # ablate.testing (the conformance kit) and kernels' test helpers
    unlisted = {m: f for m, f in third_party_imports().items() if m not in listed | first_party | test_only}
    assert not unlisted, f"imports missing from ablate/preflight.py (REQUIRED or OPTIONAL): {unlisted}"


def arms_run(arms: list[dict], rc=0) -> dict:
    """A run_cli result whose summary.csv and runs.csv hold `arms` (arm, status, decode, replays)."""
    summary = pd.DataFrame([{"arm": a["arm"], "status": a["status"], "status_detail": a.get("detail"),
                             "tpot_p50_ms": a.get("tpot", 2.0), "mbu_decode": 0.2} for a in arms])
    runs = pd.DataFrame([{"arm": a["arm"], "repeat": r, "engine.graphs": a["decode"],
                          "engine.graph_replays": a.get("replays", 0)} for a in arms for r in range(3)])
    sections = load_sections()
    return {"rc": rc, "wall_s": 1.0, "log": "x.log", "run_dir": "x", "summary": summary,
            "arms": sections.arm_states(summary, runs)}


def test_an_arm_that_ran_eagerly_instead_of_replaying_graphs_makes_decode_mbu_partial(tmp_path, monkeypatch):
    gc, sections = load_gpu_check(), load_sections()
    fell_back = [{"arm": "eager", "status": "ok", "decode": "eager", "tpot": 15.0},
                 {"arm": "graphs", "status": "ok", "decode": "eager (capture failed: operation not permitted)"}]
    monkeypatch.setattr(sections, "run_cli", lambda ctx, name, overrides, timeout: arms_run(fell_back))
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + 600, measured={"copy_bytes_s": 1e10})
    ctx.section = "decode_mbu"
    r = sections.decode_mbu(ctx)
    assert r["status"] == "partial"
    assert "graphs ran eagerly: eager (capture failed: operation not permitted)" in r["headline"]
    assert "ok/eager: eager" in r["headline"]      # every arm's status and decode mode
    replayed = [{"arm": "eager", "status": "ok", "decode": "eager", "tpot": 15.0},
                {"arm": "graphs", "status": "ok", "decode": "cuda-graphs", "replays": 126}]
    monkeypatch.setattr(sections, "run_cli", lambda ctx, name, overrides, timeout: arms_run(replayed))
    r = sections.decode_mbu(ctx)
    assert r["status"] == "ok", r["headline"]
    assert "ok/cuda-graphs (378 replays): graphs" in r["headline"] and "graphs/eager 7.50x" in r["headline"]


@pytest.mark.parametrize("arm, problem", [
    ({"arm": "flash", "status": "diverged", "decode": "eager", "detail": "2 of 4 greedy requests differ"},
     "flash diverged (2 of 4 greedy requests differ)"),
    ({"arm": "paged", "status": "failed", "decode": "eager", "detail": "RuntimeError: boom"}, "paged failed"),
    ({"arm": "spec+graphs", "status": "ok", "decode": "cuda-graphs", "replays": 0},
     "spec+graphs captured CUDA graphs but never replayed one"),
])
def test_a_failed_diverged_or_never_replaying_arm_makes_experiments_partial(tmp_path, monkeypatch, arm, problem):
    gc, sections = load_gpu_check(), load_sections()
    arms = [{"arm": "baseline", "status": "ok", "decode": "eager"}, arm]
    monkeypatch.setattr(sections, "run_cli", lambda ctx, name, overrides, timeout: arms_run(arms))
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + 600)
    ctx.section = "experiments"
    r = sections.experiments(ctx)
    assert r["status"] == "partial" and problem in r["headline"], r["headline"]
    noisy = [{"arm": "baseline", "status": "ok", "decode": "eager"},
             {"arm": "kv", "status": "noisy", "decode": "eager"}]      # contended: measured, and says so
    monkeypatch.setattr(sections, "run_cli", lambda ctx, name, overrides, timeout: arms_run(noisy))
    r = sections.experiments(ctx)
    assert r["status"] == "ok" and "noisy/eager: kv" in r["headline"]


def test_a_failed_section_is_recorded_and_the_next_still_runs(tmp_path):
    gc = load_gpu_check()
    ctx = gc.Context(tmp_path, dry=True, deadline=time.time() + 60)

    def broken(ctx):
        raise ValueError("no such kernel")

    gc.run_section("broken", broken, ctx)
    gc.run_section("fine", lambda ctx: {"value": 1.5, "headline": "all good"}, ctx)
    meta = {"started": "now", "started_at": time.time(), "budget_s": 60}
    report = gc.finish(gc.assemble(tmp_path, ["broken", "fine"], meta), ["broken", "fine"], "the worker ended")
    gc.publish(tmp_path, report)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(saved["sections"]) == ["broken", "fine"]
    assert saved["sections"]["broken"]["status"] == "failed"
    assert "ValueError: no such kernel" in saved["sections"]["broken"]["error"]   # the traceback
    assert saved["sections"]["fine"] | {"seconds": 0} == {"status": "ok", "headline": "all good",
                                                         "result": {"value": 1.5}, "seconds": 0}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## broken: failed" in md and "ValueError: no such kernel" in md and "## fine: ok" in md


@pytest.mark.slow
def test_the_dry_run_passes_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=290)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert tuple(sections) == SECTIONS, run.stdout[-3000:] + run.stderr[-3000:]
    status = {name: sec["status"] for name, sec in sections.items()}
    errors = {name: sec.get("error") or sec.get("headline") for name, sec in sections.items()}
    for name in ("preflight", "environment", "kernel_correctness", "gpu_tests", "experiments"):
        assert status[name] == "ok", errors[name]
    tests = sections["gpu_tests"]["result"]
    assert tests["passed"] > 0 and tests["failed"] == 0 and tests["cuda_only_skipped"], tests   # no CUDA here
    for name in ("kernel_timing", "decode_mbu"):        # decode timing needs CUDA; the graphs arm may be refused
        assert status[name] in ("ok", "partial"), errors[name]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert report["meta"]["dry_run"] is True
    cases = sections["kernel_correctness"]["result"]["cases"]
    kernels = {"flash_attention_varlen", "flash_attention_decode", "paged_decode_attention"}
    assert {c["kernel"] for c in cases} == kernels
    assert all(c["pass"] for c in cases)
    for name in ("ch08_kv_cache", "ch12_flash", "ablation"):
        exp = sections["experiments"]["result"][name]
        assert exp["rc"] == 0 and exp["speedups"], exp
    mbu = sections["decode_mbu"]["result"]["batches"]
    assert [row["batch"] for row in mbu] == [1, 2] and all(row["mbu_eager"] > 0 for row in mbu)
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: " in md for name in SECTIONS)
    assert "section" in run.stdout and "wrote" in run.stdout     # the closing table
