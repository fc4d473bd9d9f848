"""The conformance kit for plugins (ablate.testing.kit), also shipped as a pytest plugin
(ablate.testing.pytest_plugin): `check_plugin(slot, name)` raises ConformanceError naming the plugin
and the rule it breaks. Imported lazily: pytest loads the plugin in every run where ablate is
installed, and the kit pulls in torch and the engine."""

__all__ = ["ConformanceError", "check_plugin"]


def __getattr__(name: str):
    if name == "check_plugin":
        from ablate.testing.kit import check_plugin
        return check_plugin
    if name == "ConformanceError":
        from ablate.testing.failures import ConformanceError
        return ConformanceError
    raise AttributeError(f"module 'ablate.testing' has no attribute {name!r}")
