"""The bad-inputs battery (benchmarks/bad_inputs.py) keeps working against the current code: its
classifier sorts outcomes as documented, and a few of its fastest cases, run through its own
functions, keep their classes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bad_inputs.py"

# case name -> its class today (each is handled cleanly by the code; a change here is a regression)
FASTEST = {
    "experiment.repeats=0": "clear error",
    "model.n_heads=0": "clear error",
    "kv_cache=nonesuch": "clear error",
    "block manager: truncate past the end": "clear error",
    "block manager: allocate a sequence that holds blocks": "clear error",
}


@pytest.fixture(scope="module")
def battery():
    spec = importlib.util.spec_from_file_location("bad_inputs", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bad_inputs"] = module       # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_classifier(battery, tmp_path):
    case = battery.Case("x", [], expect="workload.rate")
    ok_case = battery.Case("x", [], want="ok")
    trace = f"{battery.TRACEBACK}\n  File \"a.py\", line 1\nValueError: bad workload.rate"
    assert battery.classify(battery.Done(2, "", "error: workload.rate must be > 0", False), case, tmp_path) \
        == ("clear error", "error: workload.rate must be > 0")
    assert battery.classify(battery.Done(1, "", trace, False), case, tmp_path) == ("traceback", "ValueError: bad workload.rate")
    assert battery.classify(battery.Done(2, "", "error: something", False), case, tmp_path)[0] == "traceback"
    assert battery.classify(battery.Done(0, "done", "", False), case, tmp_path)[0] == "silent"
    assert battery.classify(battery.Done(None, "", "", True), case, tmp_path)[0] == "hang"
    assert battery.classify(battery.Done(0, "done", "", False), ok_case, tmp_path) == ("ok", "done")
    assert battery.classify(battery.Done(3, "", "WRONG RESULT: 4 tokens", False), ok_case, tmp_path)[0] == "silent"


def test_every_case_is_declared_once(battery):
    names = [c.name for c in battery.CASES]
    assert len(names) == len(set(names)) and len(names) >= 60


@pytest.mark.slow
def test_its_fastest_cases_keep_their_classes(battery, tmp_path):
    cases = {c.name: c for c in battery.CASES}
    fixtures = battery.Fixtures(tmp_path / "fixtures")
    got = {}
    for i, name in enumerate(FASTEST):
        [row] = battery.run_case(cases[name], tmp_path / f"case{i}", fixtures)
        got[name] = (row.outcome, row.message)
    assert {name: outcome for name, (outcome, _) in got.items()} == FASTEST, got
