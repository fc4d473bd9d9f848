"""The layout keeps its promises: plugins are built on ablate.api alone, the core's modules import
each other in one direction (no cycles), and no module grows past what one reading takes."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PLUGIN_SOURCES = sorted([*REPO.glob("plugins/*/ablate_*/**/*.py"), *REPO.glob("ablate/baselines/*.py")])
MAX_LINES = 300


def imported_modules(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; with top_level_only, those run on import (not inside
    functions or `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False)
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if top or not top_level_only)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if top or not top_level_only:
                    found.append((child.lineno, child.module))
                    found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            else:
                visit(child, top)

    visit(tree, True)
    return found


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=[str(p.relative_to(REPO)) for p in PLUGIN_SOURCES])
def test_plugins_import_only_the_contract(path):
    """A plugin imports ablate.api (and ablate.api.model), never the engine's internals."""
    bad = [f"line {line}: {module}" for line, module in imported_modules(path)
           if module.split(".")[0] == "ablate" and not module.startswith("ablate.api")
           and not module.startswith("ablate.baselines")]
    assert not bad, f"{path.relative_to(REPO)} imports outside ablate.api: {bad}"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def test_the_core_has_no_import_cycles():
    modules = {module_name(p): p for p in REPO.glob("ablate/**/*.py") if "data" not in p.parts}
    # a module's own packages are imported before it anyway: `from ablate.x import y` (y a module) is not a cycle
    graph = {name: sorted({m for _, m in imported_modules(path, top_level_only=True)
                           if m in modules and m != name and not name.startswith(m + ".")})
             for name, path in modules.items()}
    state: dict[str, int] = {}            # 1: on the current path, 2: done

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [name, dep]
            if dep not in state and (found := cycle_from(dep, [*path, dep])):
                return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := cycle_from(name, [name])):
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")


SOURCES = sorted(p for p in [*REPO.glob("ablate/**/*.py"), *REPO.glob("plugins/*/ablate_*/*.py"),
                             *REPO.glob("kernels/ablate_kernels/*.py")] if "data" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_no_module_is_longer_than_one_reading(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most {MAX_LINES}): split it by concern"


def test_the_code_is_lint_clean():
    """ruff (pyproject.toml [tool.ruff]): no unused or undefined names, imports in order."""
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                          text=True, cwd=REPO)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-1000:]


def test_the_core_never_names_a_plugins_stat():
    """Reports, summaries and analyses take plugin columns (`<slot>.<key>`) from the plugins'
    declarations (Plugin.reported_stats), never from a key written into the core."""
    slots = ("variant", "kv_cache", "attention", "scheduler", "decoding")
    pattern = re.compile(r"""["'](?:%s)\.[a-z_]+["']""" % "|".join(slots))
    core = [p for p in REPO.glob("ablate/**/*.py")
            if not {"api", "testing", "baselines", "data", "checkpoints"} & set(p.parts)]   # GGUF keys look alike
    named = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in core
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not named, "the core names plugin stats:\n" + "\n".join(named)
