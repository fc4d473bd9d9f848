"""Every plugin found passes the conformance kit that third-party plugin authors use."""
from __future__ import annotations

import pytest

from ablate.api.plugin import Requirement, Slot
from ablate.engine.registry import default_registry
from ablate.testing.declarations import check_requirements_enforced

PLUGINS = sorted((slot.value, name) for slot, name in default_registry().plugins)
# attention=flash runs its Triton kernels in the interpreter on a CPU (kernels/tests/conftest.py switches it on for
# the whole process): about a minute. Its kit on the SDPA fallback stays in the default run
# (plugins/attention/tests/test_flash.py::test_flash_plugin_conforms).
SLOW = {("attention", "flash")}


@pytest.mark.parametrize(("slot", "name"), [
    pytest.param(s, n, id=f"{s}={n}", marks=[pytest.mark.slow] if (s, n) in SLOW else []) for s, n in PLUGINS])
def test_plugin_conforms(ablate_check_plugin, slot, name):
    ablate_check_plugin(slot, name)


def test_kit_catches_a_requirement_that_is_not_declared_as_enforced(ablate_registry, monkeypatch):
    """A plugin declaring it needs kv_cache=none is refused beside contiguous (the check can fail)."""
    cls = ablate_registry.get(Slot.ATTENTION, "naive")
    monkeypatch.setattr(cls, "requires", (Requirement(Slot.KV_CACHE, frozenset({"none"}), "test"),))
    check_requirements_enforced(ablate_registry, Slot.ATTENTION, "naive")   # enforced: passes
    monkeypatch.setattr("ablate.testing.declarations.check_compatible", lambda combo: None)
    with pytest.raises(AssertionError, match="ran beside"):
        check_requirements_enforced(ablate_registry, Slot.ATTENTION, "naive")
