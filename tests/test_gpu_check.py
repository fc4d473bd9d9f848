"""benchmarks/gpu_check.py: its runner keeps going past a failed section, and its dry run (the same code
on the CPU, the kernels under Triton's interpreter, tiny shapes) passes every section that can pass
without a GPU."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SECTIONS = ("environment", "kernel_correctness", "kernel_timing", "experiments", "decode_mbu")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module      # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def test_a_failed_section_is_recorded_and_the_next_still_runs(tmp_path):
    gc = load_gpu_check()
    ctx = gc.Context(tmp_path, dry=True, budget_s=60)
    report = {"meta": {"dry_run": True, "started": "now"}, "sections": {}}

    def broken(ctx):
        raise ValueError("no such kernel")

    gc.run_section("broken", broken, ctx, report)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["sections"]["broken"]["status"] == "failed"
    assert "ValueError: no such kernel" in saved["sections"]["broken"]["error"]   # the traceback
    gc.run_section("fine", lambda ctx: {"value": 1.5, "headline": "all good"}, ctx, report)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(saved["sections"]) == ["broken", "fine"]
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
    for name in ("environment", "kernel_correctness", "experiments"):
        assert status[name] == "ok", errors[name]
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
