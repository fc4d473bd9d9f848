"""The documentation as a reader meets it: README.md stays a short front door, the site under docs/
builds, and every code block of README.md and docs/*.md does what its page says.

The Markdown these tests read follows three conventions:

- A ```python block runs on its own, in a fresh module namespace, with the repository root as the
  working folder: a block is a whole program (imports included), never a fragment that continues
  another block.
- A ```python block whose first line is `# after: python -m ablate <overrides>` reads what that run
  writes. The test (slow) runs the command in a temporary folder, then the block there, with
  `<run-id>` standing for the run folder the command made. The command must be one that a ```bash
  block of the same page gives, so the two cannot drift apart.
- A ```bash block's `python -m ablate ...` commands are checked as the CLI checks them before it
  runs anything (ablate/cli.py): `plugins`, `compare`, `collect`, `repro` and `book` by their own
  argument handling; an experiment's overrides by the CLI's own checks, then composed by Hydra
  against the package's config (every job of a sweep), then turned into the typed config and the
  plan of arms. The plugin that writing-a-plugin.md writes out in full counts as installed. The
  other commands must name what exists: a script run by python or `./`, `pip install` and `pytest`
  paths, a module run with -m, and each `--option` of a repository script must appear in its source.
  Paths with a placeholder (`<...>`, `path/to/`, `~`, a wildcard) are left alone.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [README, *PAGES]
# what CI runs (.ci/run) and a newcomer types first: the README must open with exactly this block
FRONT_DOOR = """```bash
./setup.sh && .venv/bin/python -m ablate +experiment=quickstart
./setup.sh && .venv/bin/python -m pytest -m "not slow"
```
"""
README_MAX_LINES = 250
AFTER = "# after: "
PLACEHOLDER = re.compile(r"[<>*~]|path/to/")


@dataclass
class Block:
    path: Path
    line: int           # the line of the block's first code line, counted from 1
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def code_blocks(path: Path, lang: str) -> list[Block]:
    """The fenced blocks of one language in a Markdown file, with where each starts."""
    blocks, lines = [], path.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"\s*```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence.group(1) == lang:
            blocks.append(Block(path, i + 2, lang, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def all_blocks(lang: str) -> list[Block]:
    return [b for path in MARKDOWN for b in code_blocks(path, lang)]


def ids(block: Block) -> str:
    return block.where


# --- the front door ---------------------------------------------------------------------------------

def test_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert text.startswith(FRONT_DOOR), "README.md must open with the setup-and-run and setup-and-test commands"
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines; keep it to {README_MAX_LINES} and move detail to docs/")
    test_command = FRONT_DOOR.splitlines()[2]
    assert test_command in (REPO / ".ci" / "run").read_text(), "CI no longer runs the README's test command"


def test_readme_links_every_page_and_each_link_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    unlinked = [p.relative_to(REPO).as_posix() for p in PAGES if p.relative_to(REPO).as_posix() not in local]
    assert not unlinked, f"README.md's 'Where to go next' does not link {unlinked}"


def test_the_site_builds_strictly(tmp_path):
    """mkdocs --strict: a broken link or anchor between pages, a page left out of the nav, or an API
    object mkdocstrings cannot render fails the build."""
    pytest.importorskip("mkdocstrings", reason="the documentation tools come with the test extra: ./setup.sh")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for module in ("slots", "kv_cache", "kv", "sequence", "step", "plugin", "context", "executor", "sampling",
                   "packing", "rows", "clock"):
        assert f'id="ablate.api.{module}"' in api, f"the API reference does not render ablate.api.{module}"


# --- python blocks ----------------------------------------------------------------------------------

PYTHON = all_blocks("python")
AFTER_RUN = [b for b in PYTHON if b.code.startswith(AFTER)]


def run_block(block: Block, code: str | None = None) -> types.ModuleType:
    """Execute a block as a module of its own (registered, as dataclasses and pickling expect)."""
    name = "docs_block_" + re.sub(r"\W", "_", block.where)
    module = sys.modules[name] = types.ModuleType(name)
    exec(compile(code or block.code, block.where, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("block", [b for b in PYTHON if b not in AFTER_RUN], ids=ids)
def test_python_block_runs(block, monkeypatch):
    monkeypatch.chdir(REPO)
    run_block(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", AFTER_RUN, ids=ids)
def test_python_block_runs_after_its_command(block, tmp_path, monkeypatch):
    command = block.code.splitlines()[0].removeprefix(AFTER)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "ablate"], f"{block.where}: `{AFTER}` names a `python -m ablate` command"
    given = [c.args for c in page_commands(block.path) if c.ablate]
    assert words[3:] in given, f"{block.where}: no ```bash block of the page runs `{command}`"
    # on the CPU, with given peaks (no machine probe) and no W&B: what the block reads is the same
    quiet = ["device=cpu", "peak_bandwidth=1e10", "peak_flops=1e11", "wandb.mode=disabled"]
    done = subprocess.run([sys.executable, "-m", "ablate", *words[3:], *quiet], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block.where}: `{command}` failed:\n{done.stderr[-3000:]}"
    (run,) = [p.parent for p in (tmp_path / "results").glob("*/*/done.json")]
    monkeypatch.chdir(tmp_path)
    run_block(block, block.code.replace("<run-id>", run.name))


# --- bash blocks ------------------------------------------------------------------------------------

@dataclass
class Command:
    line: int                # where it starts in its file
    text: str                # as written (continuations joined)
    words: list[str]         # one command of a pipeline or list, environment assignments left out

    @property
    def ablate(self) -> bool:
        return self.python and self.words[1:3] == ["-m", "ablate"]

    @property
    def python(self) -> bool:
        return bool(self.words) and re.fullmatch(r"python3?", Path(self.words[0]).name) is not None

    @property
    def args(self) -> list[str]:
        return self.words[3:]


def commands(block: Block) -> list[Command]:
    """Each command of a bash block: lines joined at a trailing backslash, comments dropped, split at
    |, &&, || and ;, and leading VAR=value assignments left out."""
    found, lines, i = [], block.code.split("\n"), 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        words, part = shlex.split(text, comments=True), []
        for word in [*words, "|"]:
            if word in ("|", "&&", "||", ";"):
                while part and re.fullmatch(r"[A-Za-z_]\w*=.*", part[0]):
                    part.pop(0)
                if part:
                    found.append(Command(block.line + start, text.strip(), part))
                part = []
            else:
                part.append(word)
    return found


def page_commands(path: Path) -> list[Command]:
    return [c for b in code_blocks(path, "bash") for c in commands(b)]


BASH = all_blocks("bash")


@pytest.mark.parametrize("block", BASH, ids=ids)
def test_bash_block_commands_are_valid(block):
    problems = bash_problems(block)
    assert not problems, "\n".join(problems)


# commands a page might get wrong, each one mistake; the checks must refuse every one
TYPOS = [
    ".venv/bin/python -m ablate kv_cache=contigous",                        # a plugin
    ".venv/bin/python -m ablate kv_cache=paged kv_cache.blok_size=4",       # a plugin's option
    ".venv/bin/python -m ablate workload.output_lne=64",                    # a config field
    ".venv/bin/python -m ablate threads=four",                              # a typed value
    ".venv/bin/python -m ablate +experiment=ch08_kv_cahe",                  # an experiment
    ".venv/bin/python -m ablate -m kv_cache=contiguous,dynamc",             # one job of a sweep
    ".venv/bin/python -m ablate kv_cache=contiguous,dynamic",               # a sweep without -m
    ".venv/bin/python -m ablate book section=9.9",                          # the book's own option
    ".venv/bin/python -m ablate repro --procesess 3 +experiment=quickstart",    # a subcommand's flag
    ".venv/bin/python -m ablate compare results/only-one",                  # a subcommand's arguments
    ".venv/bin/python benchmarks/decode_profile.py --rouds 2",              # a script's option
    ".venv/bin/python benchmarks/decode_profle.py",                         # a script
    ".venv/bin/python -m pytest plugins/streaming/tset",                    # a path
]


@pytest.mark.parametrize("command", TYPOS)
def test_a_typo_in_a_command_fails_naming_where(command):
    block = Block(REPO / "docs" / "page.md", 7, "bash", f"# a comment line first\n{command}   # and a comment\n")
    problems = bash_problems(block)
    assert len(problems) == 1 and problems[0].startswith(f"docs/page.md:8: `{command}"), problems


def bash_problems(block: Block) -> list[str]:
    """One line per command of the block that fails its check: the file, the line, the command, why."""
    problems = []
    for command in commands(block):
        try:
            check_command(command)
        except Exception as err:        # whatever stops the command, said with where it is written
            problems.append(f"{block.path.relative_to(REPO)}:{command.line}: `{command.text}`: "
                            f"{' '.join(str(err).split())[:600]}")
    return problems


def check_command(command: Command) -> None:
    program, *rest = command.words
    if command.ablate:
        check_ablate(command.args)
    elif command.python and rest[:1] == ["-m"]:
        check_module(rest[1], rest[2:])
    elif command.python:
        script = next((w for w in rest if not w.startswith("-")), None)
        assert script is not None, "python with neither -m nor a script"
        check_script(script, rest[rest.index(script) + 1:])
    elif program == "pip" or program.endswith("/pip"):
        check_module("pip", rest)
    elif program.startswith("./") or program.endswith(".sh"):
        assert_exists(program)


def check_module(module: str, args: list[str]) -> None:
    if module == "pytest":
        for arg in args:
            if not arg.startswith("-") and ("/" in arg or arg.endswith(".py")):
                assert_exists(arg.split("::")[0])
    elif module == "pip":
        if args[:1] == ["install"]:
            for arg in args[1:]:
                if not arg.startswith("-") and "/" in arg:
                    assert_exists(arg)
    else:
        try:
            found = importlib.util.find_spec(module)
        except ImportError:         # a parent package that does not exist
            found = None
        assert found is not None, f"no module {module} to run with -m"


def check_script(script: str, args: list[str]) -> None:
    """A repository script exists and has every --option it is given."""
    if PLACEHOLDER.search(script):
        return
    assert_exists(script)
    source = (REPO / script).read_text()
    for arg in args[:args.index("--")] if "--" in args else args:
        option = arg.split("=", 1)[0]
        if option.startswith("--") and f'"{option}"' not in source and f"'{option}'" not in source:
            raise AssertionError(f"{script} has no option {option}")


def assert_exists(path: str) -> None:
    if not PLACEHOLDER.search(path):
        assert (REPO / path).exists(), f"{path} does not exist in the repository"


# --- python -m ablate, checked as the CLI checks it ---------------------------------------------------

class Parsed(Exception):
    """Raised in place of the work a subcommand would do, once its arguments are parsed."""


def check_ablate(args: list[str]) -> None:
    from ablate.cli import book_arguments
    from ablate.report import collect, compare, repro

    def parsed(*given, **_):
        raise Parsed(*given)

    if args[:1] == ["plugins"]:
        assert args == ["plugins"], "`python -m ablate plugins` takes no arguments"
    elif args[:1] == ["compare"]:
        with mock.patch.object(compare, "compare", parsed):
            subcommand(compare.main, args[1:])
    elif args[:1] == ["collect"]:
        with mock.patch.object(collect, "collect", parsed):
            subcommand(collect.main, args[1:])
    elif args[:1] == ["repro"]:
        with mock.patch.object(repro, "new_folder", lambda out, overrides: Path(out or ".")), \
                mock.patch.object(repro, "reproduce", parsed):
            overrides = subcommand(repro.main, args[1:])[0]
        check_job(overrides)
    elif args[:1] == ["book"]:
        check_job(book_arguments(args[1:]))
    else:
        check_job(args)


def subcommand(main, argv: list[str]) -> tuple:
    """The arguments a subcommand's own parser hands on; its usage error as an AssertionError."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            main(argv)
    except Parsed as done:
        return done.args
    except SystemExit:
        raise AssertionError(stderr.getvalue().strip().splitlines()[-1]) from None
    raise AssertionError("the subcommand did not get as far as its work")


@functools.cache
def docs_registry():
    """The installed plugins plus the one writing-a-plugin.md writes out (its commands run it), each
    config stored in Hydra's ConfigStore as the CLI stores them."""
    from ablate.engine.config_store import register_configs
    from ablate.engine.registry import default_registry

    (slab,) = [b for b in code_blocks(REPO / "docs" / "writing-a-plugin.md", "python") if "class SlabKVCache" in b.code]
    registry = default_registry().with_plugins(run_block(slab).SlabKVCache)
    register_configs(registry)
    return registry


def check_job(argv: list[str]) -> None:
    """What `python -m ablate <overrides>` checks before it measures anything: the CLI's own checks
    of the overrides, Hydra's composition of each job, the typed config and the plan of arms."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ablate.cli_overrides import MULTIRUN, multirun_first, override_problem
    from ablate.engine.config_store import unknown_option

    registry = docs_registry()
    argv = multirun_first(argv)
    if (message := override_problem(argv) or unknown_option(registry, argv)) is not None:
        raise ValueError(message)
    overrides = [a for a in argv if a not in MULTIRUN]
    jobs = [overrides]
    if len(overrides) < len(argv):      # -m: every job of the sweep
        jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)[0]
    for job in jobs:
        check_composed(tuple(job))


@functools.cache
def check_composed(job: tuple[str, ...]) -> None:
    """One job's overrides composed by Hydra, as the typed config and the plan of arms (cached: the
    README repeats commands the pages give)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from ablate.cli_overrides import interpolation_error
    from ablate.engine.registry import conf_dir
    from ablate.experiment.config import to_run_config
    from ablate.experiment.plan import make_plan

    registry = docs_registry()
    # results_dir defaults to ${hydra:runtime.cwd}/results, which only a running Hydra app resolves
    given = [] if any(o.startswith("results_dir=") for o in job) else ["results_dir=results"]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*job, *given], return_hydra_config=True)
    except Exception as err:        # Hydra's composition errors: an unknown group, option or value
        raise ValueError(f"{type(err).__name__}: {err}") from None
    with open_dict(cfg):
        del cfg["hydra"]            # checked in composing (a launcher and its options); a job never sees it
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except Exception as err:
        raise ValueError(interpolation_error(err)) from None
    make_plan(to_run_config(raw, registry), registry)


# --- other blocks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", all_blocks("yaml") + all_blocks("toml"), ids=ids)
def test_config_block_parses(block):
    if block.lang == "toml":
        tomllib.loads(block.code)
    else:
        yaml.safe_load(block.code)
