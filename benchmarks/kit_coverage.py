"""What the conformance kit's scenarios make plugins do, and how many broken plugins it catches.

    python benchmarks/kit_coverage.py              # every built-in plugin, then the broken fixtures
    python benchmarks/kit_coverage.py --no-broken  # the coverage table only

Runs the whole kit (ablate.testing.check_plugin) on every plugin found and prints, per plugin and
scenario, the counters the scenarios keep (ablate/testing/coverage.py): admissions and growths the
cache refused, preemptions and resumed sequences, steps with a prompt chunk that emits nothing ahead
of an emitting sequence, the peak of the cache's reserved bytes against its budget (set in the
cache's own bytes per token); for decoding plugins the sampling run's temperatures, top_p values and
steps mixing greedy and sampled requests. Then every deliberately broken plugin of
tests/broken_plugins.py goes through the kit, and the count it fails (naming the rule the test
expects) is printed as N of M.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pandas as pd

from ablate.engine.registry import default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.testing import ConformanceError, check_plugin
from ablate.testing.coverage import Coverage

TESTS = Path(__file__).resolve().parent.parent / "tests"


def values(found: set[float]) -> str:
    return ", ".join(f"{v:g}" for v in sorted(found)) or "-"


def coverage_row(plugin: str, scenario: str, c: Coverage) -> dict[str, object]:
    pressure = (f"yes: peak {c.peak_reserved_bytes / c.budget_bytes:.0%} of {c.budget_bytes} B" if c.budget_bytes
                and c.pressure else "NO" if c.budget_bytes else "-")
    return {"plugin": plugin, "scenario": scenario, "steps": c.steps, "admissions refused": c.admissions_refused,
            "growths refused": c.growths_refused, "preemptions": c.preemptions, "resumed": c.resumed,
            "silent chunk before emitter": c.chunk_before_emitter, "temperatures": values(c.temperatures),
            "top_p": values(c.top_ps), "mixed batches": c.mixed_batches, "pressure reached": pressure}


def load_module(name: str, path: Path):
    """A test helper module by its path, under `name` in sys.modules (the test imports it by that name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def broken_caught(model: LlamaModel) -> tuple[int, int, list[str]]:
    """(caught, fixtures, the ones missed and why) over tests/test_kit_catches_broken_plugins.EXPECTED."""
    load_module("broken_plugins", TESTS / "broken_plugins.py")
    expected = load_module("kit_catches", TESTS / "test_kit_catches_broken_plugins.py").EXPECTED
    registry = default_registry().with_plugins(*expected)
    caught, missed = 0, []
    for cls, rule in expected.items():
        try:
            check_plugin(cls.slot, cls.name, registry, model)
            missed.append(f"{cls.slot.value}={cls.name}: passed the kit")
        except ConformanceError as err:
            if re.search(rule, str(err)) and str(err).startswith(f"{cls.slot.value}={cls.name} "):
                caught += 1
            else:
                missed.append(f"{cls.slot.value}={cls.name}: failed for another reason: {err}")
    return caught, len(expected), missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-broken", action="store_true", help="skip the broken fixtures (the N of M line)")
    args = parser.parse_args()
    registry, model = default_registry(), LlamaModel.random(preset("tiny"))
    rows = []
    for slot, name in sorted(registry.plugins, key=lambda p: (p[0].value, p[1])):
        report = check_plugin(slot, name, registry, model)
        rows += [coverage_row(report.plugin, scenario, c) for scenario, c in report.coverage.items()]
        if report.sampling_coverage is not None:
            rows.append(coverage_row(report.plugin, "sampling", report.sampling_coverage))
    print(pd.DataFrame(rows).to_markdown(index=False))
    if not args.no_broken:
        caught, total, missed = broken_caught(model)
        print(f"\nbroken fixtures caught: {caught} of {total}")
        for line in missed:
            print(f"  missed: {line}")


if __name__ == "__main__":
    main()
