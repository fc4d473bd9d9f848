"""The plugin the documentation writes out in full (docs/writing-a-plugin.md, "A whole cache") passes
the conformance kit as printed."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md"


def docs_plugin_module() -> types.ModuleType:
    """The page's `SlabKVCache` code block, executed as a module of its own."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "class SlabKVCache" in b]
    module = sys.modules["docs_slab"] = types.ModuleType("docs_slab")
    exec(compile(code, "docs/writing-a-plugin.md:SlabKVCache", "exec"), module.__dict__)
    return module


def test_the_documented_cache_passes_the_kit(ablate_registry, ablate_tiny_model):
    from ablate.testing import check_plugin

    slab = docs_plugin_module().SlabKVCache
    check_plugin("kv_cache", "slab", ablate_registry.with_plugins(slab), ablate_tiny_model)
