"""Every benchmark script still imports and parses its arguments against the current code (their
figures are measured by hand; this keeps them runnable)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))

CHECK = """
import os, runpy, sys
failures = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))     # as `python path` does: its folder's modules import
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (0, None):
            failures.append(f"{path}: exit {exit.code}")
    except Exception as err:
        failures.append(f"{path}: {type(err).__name__}: {err}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


@pytest.mark.slow      # one process importing every benchmark (~20 s; host_syncs.py has no --help and runs in full)
def test_every_benchmark_imports_and_shows_its_help():
    run = subprocess.run([sys.executable, "-c", CHECK, *map(str, BENCHMARKS)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
