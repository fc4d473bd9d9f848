"""The plugin the README writes out in full ("Writing a plugin") passes the conformance kit as printed."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_plugin_module() -> types.ModuleType:
    """The README's `SlabKVCache` code block, executed as a module of its own."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "class SlabKVCache" in b]
    module = sys.modules["readme_slab"] = types.ModuleType("readme_slab")
    exec(compile(code, "README.md:SlabKVCache", "exec"), module.__dict__)
    return module


def test_the_readme_cache_passes_the_kit(ablate_registry, ablate_tiny_model):
    from ablate.testing import check_plugin

    slab = readme_plugin_module().SlabKVCache
    check_plugin("kv_cache", "slab", ablate_registry.with_plugins(slab), ablate_tiny_model)
