"""The layout keeps its promises: plugins are built on ablate.api alone, the core's packages import
each other in one direction (LAYERS, bottom to top) and its modules form no cycle, and no module grows
past what one reading takes."""
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


# The packages of ablate/, bottom to top: each imports only packages below it (at module level or
# inside a function alike), so no two packages import each other. Why each sits where it does:
LAYERS = {
    "(leaves)": "the top-level modules but the CLI's (results.py, field_types.py, exit_status.py, preflight.py, "
                "...): they import nothing of ablate",
    "api": "the plugin contract: what every plugin, and the core, is built on",
    "baselines": "the core's own plugins, built on ablate.api alone like any other",
    "model": "the decoder: its attention and KV cache are reached through the contract's slots",
    "checkpoints": "loaders build models from GGUF and Hugging Face files; tokenizers",
    "workload": "requests and their text (tokenizers) and arrivals",
    "engine": "the loop: runs a model with one arm's plugins over a workload; its hooks (StepHook), "
              "the clock of ablate.api.clock; it knows no outside engine",
    "analysis": "arithmetic on configs and tables: roofline, costs, statistics, the ablation's plan (whose "
                "techniques are arm specs: ablate.engine.arm) and contributions; it measures nothing",
    "measure": "measures the engine's runs (recorder, metrics, ArmRun, memory, quality, verify cost) and the "
               "machine (peaks, CPU load), with the analysis's cost model",
    "testing": "the conformance kit: builds arms and checks plugins with the engine's hooks and the measurements",
    "outside": "outside engines as arms: resolved above the engine (outside.arms), measured into the same ArmRun",
    "book": "the chapter's claims: evidence from the analysis, quick measurements and stored results",
    "report": "renders runs: tables, figures, the page (with the book's chapter tables and the ablation's "
              "contributions), compare, collect, W&B",
    "experiment": "the typed config (it holds the report's W&B and the book's configs), arms and plans, the "
                  "interleaved experiment, and the jobs of each kind (engine, costs, book)",
    "cli": "python -m ablate (cli.py, __main__.py): parses, composes and runs a job",
}
# The only imports that go up, each with its reason. Plugins import ablate.api alone, so the model
# toolkit they need is re-exported there; nothing in ablate/ imports these two, so they close no loop.
FACADES = {
    "ablate/api/model.py": "ablate.api.model, for plugins that build models: re-exports model, checkpoints "
                           "(load_model), workload (calibration_text) and measure (sequence_logits)",
    "ablate/api/native.py": "ablate.api.native, for plugins that call the native CPU kernels: re-exports "
                            "ablate.model.native",
}
TOP_LEVEL_COMMANDS = {"cli", "__main__"}    # the other top-level modules are leaves


def unit_of(module: str) -> str | None:
    """The layer of `ablate.<x>...` (x a package or a top-level module); None for `ablate` itself."""
    parts = module.split(".")
    if parts[0] != "ablate" or len(parts) < 2:
        return None
    if (REPO / "ablate" / parts[1]).is_dir():
        return parts[1]
    return "cli" if parts[1] in TOP_LEVEL_COMMANDS else "(leaves)"


def package_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, its layer, the layer it imports) for every import of ablate/ across layers."""
    found = set()
    for path in REPO.glob("ablate/**/*.py"):
        if "data" in path.parts or path == REPO / "ablate" / "__init__.py":
            continue
        src = unit_of(module_name(path))
        for line, module in imported_modules(path):
            if (dst := unit_of(module)) is not None and dst != src:
                found.add((str(path.relative_to(REPO)), line, src, dst))
    return sorted(found)


def test_every_package_has_its_place_in_the_layers():
    units = {unit_of(module_name(p)) for p in REPO.glob("ablate/**/*.py") if "data" not in p.parts} - {None}
    assert not units - set(LAYERS), f"place these in LAYERS, with the reason: {sorted(units - set(LAYERS))}"


def test_packages_import_only_the_packages_below_them():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{path}:{line}: {src} imports {dst}" for path, line, src, dst in package_imports()
              if rank[dst] > rank[src] and path not in FACADES]
    assert not upward, "an import goes up the layers (tests/test_architecture.py LAYERS):\n" + "\n".join(upward)


def test_nothing_in_ablate_imports_the_plugin_facades():
    """The facades' upward imports close no loop only while nothing below imports them."""
    facades = {module_name(REPO / f) for f in FACADES}
    users = [f"{p.relative_to(REPO)}:{line}: {module}" for p in REPO.glob("ablate/**/*.py")
             for line, module in imported_modules(p) if module in facades and str(p.relative_to(REPO)) not in FACADES]
    assert not users, "\n".join(users)


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
