"""`import ablate` leaves the process's environment alone; the CLI's start sets what it must before torch
and numpy load (ablate/process_env.py), what the environment sets wins, and a run records it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ablate import process_env
from ablate.model import numpy_blas

OURS = tuple(process_env.SETTINGS)


def fresh_python(code: str, **env: str) -> str:
    """`code` run in a fresh interpreter whose environment holds none of ablate's settings (plus `env`):
    its stdout."""
    base = {k: v for k, v in os.environ.items() if k not in OURS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base | env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


IMPORTS = """
import os
import torch                    # torch's own doings are not ablate's
before = dict(os.environ)
import ablate, ablate.model.linear, ablate.model.product_paths, ablate.engine.runner
print(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)))
"""


def test_importing_ablate_sets_no_environment_variable():
    assert fresh_python(IMPORTS).strip() == "[]"


APPLY = """
import json, sys
{before}
from ablate import process_env
print(json.dumps(process_env.apply()))
"""


@pytest.mark.parametrize("numpy_first", [False, True])
def test_the_cli_start_sets_each_variable_the_environment_does_not(numpy_first):
    record = json.loads(fresh_python(APPLY.format(before="import numpy" if numpy_first else ""),
                                     THP_MEM_ALLOC_ENABLE="0"))
    assert record["THP_MEM_ALLOC_ENABLE"] == "0"                  # the environment's own wins
    assert record["OPENBLAS_THREAD_TIMEOUT"] == "20" and record["set_by_ablate"] == ["OPENBLAS_THREAD_TIMEOUT"]
    assert record["applied_at_start"]
    # OpenBLAS reads its timeout when numpy loads: set after that, it bounds nothing
    assert record["numpy_spin_bounded"] is not numpy_first


def test_the_cli_sets_them_before_torch_and_numpy_load():
    out = fresh_python("import sys, os\nimport ablate.cli\n"
                       "print('torch' in sys.modules, os.environ['THP_MEM_ALLOC_ENABLE'])\n"
                       "from ablate import process_env\nprint(process_env.record()['numpy_spin_bounded'])")
    assert out.split() == ["True", "1", "True"]      # torch loaded by the CLI's imports, after the settings


def test_numpy_takes_products_on_one_thread_only_where_its_workers_spin_unbounded(monkeypatch):
    """numpy loaded before OPENBLAS_THREAD_TIMEOUT was set: its workers would spin into torch's next
    steps, so numpy's BLAS is not offered on more than one thread; on one thread nothing spins."""
    monkeypatch.setattr(process_env, "numpy_spin_bounded", lambda: False)
    assert "spin unbounded" in numpy_blas.unavailable_reason(2)
    assert not numpy_blas.blas_threads(2)
    if numpy_blas.blas_threads(1):
        assert numpy_blas.unavailable_reason(1) is None
