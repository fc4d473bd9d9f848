"""ablate's pytest plugin (entry point `pytest11: ablate`), active in every pytest run where ablate
is installed — including a third-party plugin package's own test suite, which gets:

- the `slow` marker;
- fixtures `ablate_registry` (the plugins found), `ablate_tiny_model` (seeded random `tiny`
  preset), `ablate_baseline_engine` (an engine of the core baselines over that model);
- `ablate_check_plugin(slot, name)`: the conformance kit (`ablate.testing.kit`); it returns and
  prints what the kit ran and measured (shown with `pytest -s`).
"""
from __future__ import annotations

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (CI runs them all)")


@pytest.fixture(scope="session")
def ablate_registry():
    from ablate.engine.registry import default_registry
    return default_registry()


@pytest.fixture(scope="session")
def ablate_tiny_model():
    from ablate.model.presets import preset
    from ablate.model.llama import LlamaModel
    return LlamaModel.random(preset("tiny"))


@pytest.fixture
def ablate_baseline_engine(ablate_registry, ablate_tiny_model):
    from ablate.api.context import EngineConfig
    from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
    arm = resolve_arm("baseline", {}, baseline_configs(ablate_registry), ablate_registry)
    built = build_arm(arm, ablate_tiny_model, EngineConfig(), ablate_tiny_model.config.max_seq_len, ablate_registry)
    yield built.engine
    built.close()


@pytest.fixture
def ablate_check_plugin(ablate_registry, ablate_tiny_model):
    from ablate.testing.kit import check_plugin

    def check(slot: str, name: str):
        report = check_plugin(slot, name, ablate_registry, ablate_tiny_model)
        print(report)            # shown with pytest -s (or -rP): what was run and measured
        return report
    return check
