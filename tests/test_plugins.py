"""Plugin discovery: built-ins, unknown names, incompatible combinations, broken and blocked plugins,
and a third-party plugin installed as a real package."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib.metadata import EntryPoint, PathDistribution, entry_points
from pathlib import Path

import pandas as pd
import pytest

import ablate.engine.registry as registry_mod
import ablate.experiment.job
from ablate.api.plugin import PluginConfig, Requirement, Slot
from ablate.baselines import NaiveAttention
from ablate.engine.arm import IncompatiblePlugins, baseline_configs, check_compatible, resolve_arm
from ablate.engine.registry import GROUP, AmbiguousPlugin, PluginInfo, Registry, UnknownPlugin, discover
from ablate.model.llama import LlamaModel
from ablate_kv_cache.contiguous import ContiguousKVCache
from ablate_kv_cache.dynamic import DynamicKVCache
from fake_distributions import fake_distribution

BUILT_INS = {
    ("variant", "none"): "ablate",
    ("kv_cache", "none"): "ablate",
    ("kv_cache", "contiguous"): "ablate-kv-cache",
    ("kv_cache", "dynamic"): "ablate-kv-cache",
    ("attention", "naive"): "ablate",
    ("scheduler", "static"): "ablate",
    ("decoding", "autoregressive"): "ablate",
}
REPO = Path(__file__).resolve().parent.parent


def test_discovery_lists_the_built_in_plugins_with_their_packages(registry):
    table = {(r["slot"], r["name"]): r for r in registry.table()}
    for key, source in BUILT_INS.items():
        assert table[key]["source"] == source and table[key]["status"] == "loaded", key
    assert table[("kv_cache", "contiguous")]["target"] == "ablate_kv_cache.contiguous:ContiguousKVCache"
    assert registry.get(Slot.KV_CACHE, "dynamic") is DynamicKVCache
    assert registry.get(Slot.ATTENTION, "naive") is NaiveAttention
    assert {"none", "contiguous", "dynamic"} <= set(registry.choices(Slot.KV_CACHE))


def test_unknown_plugin_names_the_valid_choices(registry):
    with pytest.raises(UnknownPlugin, match=r"unknown kv_cache plugin 'nonexistent'; valid choices: ") as err:
        registry.get(Slot.KV_CACHE, "nonexistent")
    choices = str(err.value).split("valid choices: ", 1)[1].split(", ")
    assert {"contiguous", "dynamic", "none"} <= set(choices)
    assert choices == registry.choices(Slot.KV_CACHE)
    with pytest.raises(UnknownPlugin, match=r"unknown attention plugin 'no-such-attention'; valid choices: .*naive"):
        resolve_arm("fast", {"attention": "no-such-attention"}, baseline_configs(registry), registry)


def test_unknown_plugin_option_names_the_valid_ones(registry):
    with pytest.raises(ValueError, match=r"kv_cache=dynamic has no option block_size; its options are: ") as err:
        resolve_arm("x", {"kv_cache": {"name": "dynamic", "block_size": 16}}, baseline_configs(registry), registry)
    assert {"budget_bytes", "initial_tokens"} <= set(str(err.value).split("its options are: ")[1].split(", "))
    with pytest.raises(ValueError, match=r"kv_cache.initial_tokens must be >= 1"):
        resolve_arm("x", {"kv_cache": {"name": "dynamic", "initial_tokens": 0}}, baseline_configs(registry), registry)


@pytest.mark.slow
def test_cli_unknown_plugin_names_the_valid_choices(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ablate", "kv_cache=nonexistent", f"results_dir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert proc.returncode != 0
    assert "nonexistent" in proc.stderr
    options = proc.stderr.split("Available options in 'kv_cache':", 1)[1].split()
    assert {"contiguous", "dynamic", "none"} <= set(options)
    assert not (tmp_path / "default").exists()          # nothing ran


# -- incompatible combinations --------------------------------------------------------------------------

@dataclass
class PagedOnlyConfig(PluginConfig):
    name: str = "paged-only"


class PagedOnlyAttention(NaiveAttention):
    """An attention kernel that reads block tables: it needs a paged KV cache."""

    name = "paged-only"
    config_class = PagedOnlyConfig
    requires = (Requirement(Slot.KV_CACHE, frozenset({"paged"}), "it reads the cache's block tables"),)


NEEDS_PAGED = PagedOnlyAttention.requires


def test_check_compatible_names_both_plugins_and_the_reason():
    with pytest.raises(IncompatiblePlugins) as err:
        check_compatible({Slot.ATTENTION: PagedOnlyAttention, Slot.KV_CACHE: ContiguousKVCache})
    message = str(err.value)
    assert "attention=paged-only" in message and "kv_cache=contiguous" in message
    assert "['paged']" in message and "block tables" in message
    with pytest.raises(IncompatiblePlugins, match="kv_cache=nothing"):
        check_compatible({Slot.ATTENTION: PagedOnlyAttention})
    # a requirement that holds passes
    PagedOnlyAttention.requires = (Requirement(Slot.KV_CACHE, frozenset({"contiguous", "dynamic"}), "slots"),)
    try:
        check_compatible({Slot.ATTENTION: PagedOnlyAttention, Slot.KV_CACHE: DynamicKVCache})
    finally:
        PagedOnlyAttention.requires = NEEDS_PAGED


def with_plugin(registry: Registry, cls) -> Registry:
    info = PluginInfo(f"{cls.slot.value}.{cls.name}", f"{__name__}:{cls.__name__}", "tests", "loaded",
                      cls.slot.value, cls.name, cls)
    return Registry([*registry.infos, info])


def test_incompatible_combination_is_refused_before_any_model_loads(registry, compose_config, tmp_path, monkeypatch):
    reg = with_plugin(registry, PagedOnlyAttention)
    raw = compose_config(tmp_path, "wandb.mode=disabled")
    raw["attention"] = {"name": "paged-only"}
    raw["kv_cache"] = {"name": "contiguous"}

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for an incompatible combination")

    monkeypatch.setattr(ablate.experiment.job, "load_model", no_model)
    monkeypatch.setattr(LlamaModel, "random", no_model)
    with pytest.raises(IncompatiblePlugins, match=r"attention=paged-only cannot run with kv_cache=contiguous"):
        ablate.experiment.job.run_job(raw, reg, swallow_errors=True)      # refused even in a sweep
    assert not (tmp_path / "results").exists()                 # not even a results folder
    # and in an experiment's arms
    with pytest.raises(IncompatiblePlugins, match="attention=paged-only"):
        resolve_arm("fast", {"attention": "paged-only", "kv_cache": "dynamic"}, baseline_configs(reg), reg)


# -- broken, duplicate and blocked plugins -----------------------------------------------------------

class NotAPlugin:
    pass


@dataclass
class MisnamedConfig(PluginConfig):
    name: str = "something-else"


class MisnamedCache(ContiguousKVCache):
    name = "misnamed"
    config_class = MisnamedConfig


@dataclass
class OtherContiguousConfig(PluginConfig):
    name: str = "contiguous"


class OtherContiguous(ContiguousKVCache):
    config_class = OtherContiguousConfig


@dataclass
class ShinyConfig(PluginConfig):
    name: str = "shiny"


class ShinyA(ContiguousKVCache):
    name = "shiny"
    config_class = ShinyConfig


class ShinyB(ContiguousKVCache):
    name = "shiny"
    config_class = ShinyConfig


def discover_with(monkeypatch, *extra: EntryPoint, blocked: tuple[str, ...] = ()) -> Registry:
    real = list(entry_points(group=GROUP))
    monkeypatch.setattr(registry_mod, "entry_points", lambda group: [*real, *extra] if group == GROUP else [])
    return discover(blocked)


def test_broken_plugin_is_a_warning_naming_it_not_a_crash(monkeypatch):
    broken = [
        EntryPoint("kv_cache.broken", "ablate_no_such_module_xyz:Cache", GROUP),
        EntryPoint("attention.not-a-plugin", f"{__name__}:NotAPlugin", GROUP),
        EntryPoint("kv_cache.misnamed", f"{__name__}:MisnamedCache", GROUP),
    ]
    with pytest.warns(UserWarning) as warned:
        reg = discover_with(monkeypatch, *broken)
    messages = "\n".join(str(w.message) for w in warned)
    assert "'kv_cache.broken'" in messages and "ModuleNotFoundError" in messages
    assert "'attention.not-a-plugin'" in messages and "not a subclass of ablate.api.plugin.Plugin" in messages
    assert "'kv_cache.misnamed'" in messages and "expected 'misnamed'" in messages
    # the others load as usual
    for slot, name in BUILT_INS:
        assert name in reg.choices(Slot(slot))
    assert "broken" not in reg.choices(Slot.KV_CACHE)
    rows = {r["name"]: r for r in reg.table()}
    assert rows["broken"]["slot"] == "kv_cache" and rows["broken"]["status"].startswith("error: ModuleNotFoundError")
    # asking for it says why it is missing
    with pytest.raises(UnknownPlugin, match=r"kv_cache.broken from \? is error: ModuleNotFoundError"):
        reg.get(Slot.KV_CACHE, "broken")


# -- what a distribution's import may do, and two distributions naming one plugin ---------------------------

def distribution_points(dist: PathDistribution) -> list[EntryPoint]:
    return list(dist.entry_points.select(group=GROUP))


# Every way an import can end other than an Exception: it must not end discovery (nor ablate) with it
LEAVES_AT_IMPORT = {
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", "SystemExit: it calls sys.exit(0) when imported"),
    "sys.exit(3)": ("import sys\nsys.exit(3)\n", "SystemExit: it calls sys.exit(3) when imported"),
    "sys.exit(message)": ("import sys\nsys.exit('no GPU here')\n",
                          "SystemExit: it calls sys.exit('no GPU here') when imported"),
    "raise SystemExit": ("raise SystemExit\n", "SystemExit: it calls sys.exit(None) when imported"),
    "GeneratorExit": ("raise GeneratorExit('odd')\n", "GeneratorExit: odd"),
    "own BaseException": ("class Abort(BaseException):\n    pass\nraise Abort('stop')\n", "Abort: stop"),
}


@pytest.mark.parametrize("how", LEAVES_AT_IMPORT)
def test_a_plugin_leaving_at_import_is_a_broken_plugin(how, tmp_path, monkeypatch):
    code, reason = LEAVES_AT_IMPORT[how]
    module = f"ablate_leaves_{abs(hash(how))}"
    fake_distribution(tmp_path, "ablate-leaves", "2.0", {"kv_cache.leaves": f"{module}:Cache"}, {module: code})
    monkeypatch.syspath_prepend(str(tmp_path))         # installed: found as any other distribution is
    with pytest.warns(UserWarning) as warned:
        reg = discover()
    (message,) = [str(w.message) for w in warned]
    assert message == (f"ablate: plugin 'kv_cache.leaves' ({module}:Cache, from ablate-leaves 2.0) could not be loaded "
                       f"and is skipped: {reason}")
    for slot, name in BUILT_INS:                     # the rest go on
        assert name in reg.choices(Slot(slot))
    row = next(r for r in reg.table() if r["name"] == "leaves")
    assert (row["slot"], row["source"], row["version"], row["status"]) == ("kv_cache", "ablate-leaves", "2.0",
                                                                          f"error: {reason}")
    with pytest.raises(UnknownPlugin, match=r"\(kv_cache.leaves from ablate-leaves is error: " + re.escape(reason)):
        reg.get(Slot.KV_CACHE, "leaves")


def test_ctrl_c_during_a_plugins_import_still_interrupts(tmp_path, monkeypatch):
    """The user's KeyboardInterrupt is theirs, not the plugin's failure: discovery stops."""
    fake_distribution(tmp_path, "ablate-slow", "1.0", {"kv_cache.slow": "ablate_slow_import:Cache"},
                      {"ablate_slow_import": "raise KeyboardInterrupt\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        discover()


def rival_contiguous(tmp_path: Path) -> PathDistribution:
    """A third-party distribution whose kv_cache plugin is also called `contiguous`."""
    return fake_distribution(tmp_path, "other-kv", "1.5", {"kv_cache.contiguous": f"{__name__}:OtherContiguous"})


def test_a_built_in_name_supplied_twice_is_refused_naming_both(tmp_path, monkeypatch):
    rival = distribution_points(rival_contiguous(tmp_path))
    with pytest.warns(UserWarning, match=r"kv_cache=contiguous is ambiguous: supplied by ablate-kv-cache 0\.1\.0 "
                                         r"\(ablate_kv_cache.contiguous:ContiguousKVCache\) and other-kv 1\.5 "
                                         r"\(tests.test_plugins:OtherContiguous\)"):
        reg = discover_with(monkeypatch, *rival)
    assert "contiguous" not in reg.choices(Slot.KV_CACHE) and "dynamic" in reg.choices(Slot.KV_CACHE)
    rows = {r["source"]: r for r in reg.table() if r["name"] == "contiguous"}
    assert set(rows) == {"ablate-kv-cache", "other-kv"}
    assert rows["other-kv"]["status"] == ("ambiguous: kv_cache=contiguous is also supplied by ablate-kv-cache "
                                          "(ablate_kv_cache.contiguous:ContiguousKVCache)")
    assert rows["ablate-kv-cache"]["status"].endswith("also supplied by other-kv (tests.test_plugins:OtherContiguous)")
    with pytest.raises(AmbiguousPlugin) as err:
        resolve_arm("x", {"kv_cache": "contiguous"}, baseline_configs(reg), reg)
    hint = re.search(r"ABLATE_BLOCK_PLUGINS=(\S+) keeps (\S+)'s", str(err.value))
    assert hint, err.value
    # following the message's own advice chooses one; blocking the other way round chooses the other
    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", hint.group(1))
    kept = discover_with(monkeypatch, *rival)
    assert kept.distribution(Slot.KV_CACHE, "contiguous").name == hint.group(2)
    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", "ablate_KV.cache:kv_cache.contiguous")   # any spelling of the name
    theirs = discover_with(monkeypatch, *rival)
    assert theirs.get(Slot.KV_CACHE, "contiguous") is OtherContiguous
    supplier = theirs.distribution(Slot.KV_CACHE, "contiguous")
    assert (supplier.name, supplier.version) == ("other-kv", "1.5")
    assert Path(__file__).resolve() in supplier.files


def test_two_third_party_distributions_naming_one_plugin_are_refused(tmp_path, monkeypatch):
    first = fake_distribution(tmp_path / "a", "shiny-a", "1.0", {"kv_cache.shiny": f"{__name__}:ShinyA"})
    second = fake_distribution(tmp_path / "b", "shiny-b", "2.0", {"kv_cache.shiny": f"{__name__}:ShinyB"})
    points = [*distribution_points(first), *distribution_points(second)]
    with pytest.warns(UserWarning, match="kv_cache=shiny is ambiguous"):
        reg = discover_with(monkeypatch, *points)
    for order in (points, points[::-1]):                 # whichever the listing names first
        with pytest.warns(UserWarning):
            reg = discover_with(monkeypatch, *order)
        with pytest.raises(AmbiguousPlugin, match=r"^kv_cache=shiny is ambiguous: supplied by shiny-a 1\.0 "
                                                   r"\(tests.test_plugins:ShinyA\) and shiny-b 2\.0 "
                                                   r"\(tests.test_plugins:ShinyB\); keep one by blocking"):
            reg.get(Slot.KV_CACHE, "shiny")
    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", "shiny-a:kv_cache.shiny")
    assert discover_with(monkeypatch, *points).get(Slot.KV_CACHE, "shiny") is ShinyB


@pytest.mark.parametrize("target", ["ablate_kv_cache.contiguous:ContiguousKVCache",   # as the package declares it
                                    f"{__name__}:ContiguousKVCache"])                    # the same class, imported
def test_one_class_declared_twice_is_not_ambiguous(target, tmp_path, monkeypatch):
    """An editable install beside a regular one of the same package: the same class, found twice."""
    again = fake_distribution(tmp_path, "ablate-kv-cache", "0.1.0", {"kv_cache.contiguous": target})
    reg = discover_with(monkeypatch, *distribution_points(again))
    assert reg.get(Slot.KV_CACHE, "contiguous") is ContiguousKVCache
    assert [r["status"] for r in reg.table() if r["name"] == "contiguous"] == ["loaded"]


def test_an_ambiguous_choice_is_refused_before_any_model_loads(tmp_path, monkeypatch, compose_config):
    with pytest.warns(UserWarning):
        reg = discover_with(monkeypatch, *distribution_points(rival_contiguous(tmp_path / "site")))
    raw = compose_config(tmp_path, "wandb.mode=disabled")
    raw["kv_cache"] = {"name": "contiguous"}

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for an ambiguous plugin")

    monkeypatch.setattr(ablate.experiment.job, "load_model", no_model)
    monkeypatch.setattr(LlamaModel, "random", no_model)
    with pytest.raises(AmbiguousPlugin, match="ablate-kv-cache 0.1.0 .* and other-kv 1.5"):
        ablate.experiment.job.run_job(raw, reg, swallow_errors=True)
    assert not (tmp_path / "results").exists()


def test_the_distribution_of_a_plugin_names_its_code(registry):
    contiguous = registry.distribution(Slot.KV_CACHE, "contiguous")
    assert (contiguous.name, contiguous.version) == ("ablate-kv-cache", "0.1.0")
    package = REPO / "plugins" / "kv_cache" / "ablate_kv_cache"
    assert package / "contiguous.py" in contiguous.files and package / "paged.py" in contiguous.files
    assert all(p.is_file() and p.suffix != ".pyc" for p in contiguous.files)
    assert list(contiguous.files) == sorted(contiguous.files)
    naive = registry.distribution(Slot.ATTENTION, "naive")
    assert naive.name == "ablate" and REPO / "ablate" / "baselines" / "naive_attention.py" in naive.files
    under_test = registry.with_plugins(PagedOnlyAttention).distribution(Slot.ATTENTION, "paged-only")
    assert under_test.name == "(not installed)" and Path(__file__).resolve() in under_test.files


def test_block_plugins_env_blocks_one(monkeypatch):
    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", "kv_cache.dynamic")
    reg = discover()
    assert "dynamic" not in reg.choices(Slot.KV_CACHE) and "contiguous" in reg.choices(Slot.KV_CACHE)
    row = next(r for r in reg.table() if r["name"] == "dynamic")
    assert (row["slot"], row["source"], row["status"]) == ("kv_cache", "ablate-kv-cache", "blocked")
    why = r"valid choices: .*contiguous.*\(kv_cache.dynamic from ablate-kv-cache is blocked\)"
    with pytest.raises(UnknownPlugin, match=why):
        reg.get(Slot.KV_CACHE, "dynamic")
    # several, comma-separated, and the `blocked` argument too
    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", "kv_cache.dynamic,kv_cache.contiguous")
    assert "contiguous" not in discover().choices(Slot.KV_CACHE)
    monkeypatch.delenv("ABLATE_BLOCK_PLUGINS")
    assert "naive" not in discover(("attention.naive",)).choices(Slot.ATTENTION)


# -- a third-party plugin, installed as a package --------------------------------------------------------

RECORDING = '''
"""kv_cache=recording: the contiguous cache, counting the tokens it writes."""
from dataclasses import dataclass

from ablate.api import Stat
from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache


@dataclass
class RecordingConfig(ContiguousConfig):
    name: str = "recording"


class RecordingKVCache(ContiguousKVCache):
    name = "recording"
    config_class = RecordingConfig
    reported_stats = ContiguousKVCache.reported_stats + (Stat("recorded_writes", "K/V rows written", "count"),)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.writes = 0

    def write(self, layer, step, k, v):
        self.writes += k.shape[0]
        super().write(layer, step, k, v)

    def stats(self):
        return super().stats() | {"recorded_writes": self.writes}
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.0.1"
dependencies = ["ablate"]

[project.entry-points."ablate.plugins"]
"{entry_point}" = "{target}"

[tool.setuptools]
packages = ["{module}"]
'''


def write_package(root: Path, name: str, module: str, entry_point: str, target: str, code: str) -> Path:
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text(textwrap.dedent(code))
    (root / "pyproject.toml").write_text(PYPROJECT.format(name=name, module=module, entry_point=entry_point,
                                                          target=target))
    return root


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """Two packages installed with pip into a folder of their own: a working kv_cache plugin and
    one whose import fails."""
    root = tmp_path_factory.mktemp("third-party")
    good = write_package(root / "recording", "ablate-recording-kv", "ablate_recording_kv", "kv_cache.recording",
                         "ablate_recording_kv:RecordingKVCache", RECORDING)
    bad = write_package(root / "broken", "ablate-broken-plugin", "ablate_broken_plugin", "attention.broken",
                        "ablate_broken_plugin:BrokenAttention",
                        'raise ImportError("ablate_broken_plugin needs libbroken, which is not installed")\n')
    site = root / "site"
    # offline: no index, and the venv's own setuptools builds the wheels (torch requires
    # setuptools >= 77, which builds wheels without the `wheel` package)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "--target", str(site), str(good), str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    assert len(list(site.glob("*.dist-info"))) == 2
    return site


def run_cli(site: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path,
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ablate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_installed_third_party_plugin_is_listed_and_runs(plugin_site, tmp_path):
    assert "ablate_recording_kv" not in sys.modules      # this process never imported it
    listing = run_cli(plugin_site, tmp_path, "plugins")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.split("\n\n")[0].splitlines()[1:]           # then the engines
    rows = [line.rstrip().split(None, 4) for line in lines]
    by_name = {(r[0], r[1]): r for r in rows}
    assert by_name[("kv_cache", "recording")][2:] == ["ablate-recording-kv", "0.0.1", "loaded"]
    broken = by_name[("attention", "broken")]
    assert broken[2:4] == ["ablate-broken-plugin", "0.0.1"]
    assert broken[4].startswith("error: ImportError: ablate_broken_plugin needs libbroken")
    for (slot, name), source in BUILT_INS.items():
        assert by_name[(slot, name)][2:5:2] == [source, "loaded"]
    assert "'attention.broken'" in listing.stderr            # the warning names it

    results = tmp_path / "results"
    run = run_cli(plugin_site, tmp_path, "kv_cache=recording", "wandb.mode=disabled", f"results_dir={results}",
                  "experiment.repeats=1", "experiment.warmup=0", "workload.num_requests=2",
                  "workload.output_len=4", "workload.prompt_len=8", "device=cpu", "threads=1",
                  "peak_bandwidth=1e10", "peak_flops=1e11")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'attention.broken'" in run.stderr                # still a warning, not a crash
    (runs_csv,) = results.rglob("runs.csv")
    assert (runs_csv.parent / "done.json").exists()
    runs = pd.read_csv(runs_csv)
    assert list(runs["arm"]) == ["baseline", "kv_cache=recording"]
    assert list(runs["label"]) == ["baseline", "kv_cache=recording"]
    recording = runs.set_index("arm").loc["kv_cache=recording"]
    # the plugin's own code ran: 2 layers x (2 x 8 prompt tokens + 3 decode steps x 2 sequences)
    assert recording["kv_cache.recorded_writes"] == 2 * (16 + 6)
    assert recording["kv_reserved_peak_bytes"] == 8 * 12 * 512          # contiguous: 8 slots x 12 tokens
    assert recording["output_tokens"] == 8


# -- the same, through the command line ---------------------------------------------------------------------

TINY_RUN = ("wandb.mode=disabled", "experiment.repeats=1", "experiment.warmup=0", "workload.num_requests=2",
            "workload.output_len=4", "workload.prompt_len=8", "device=cpu", "threads=1", "peak_bandwidth=1e10",
            "peak_flops=1e11")


@pytest.mark.slow
def test_cli_goes_on_past_a_plugin_that_exits_at_import(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "ablate-exits", "0.3", {"kv_cache.exits": "ablate_exits_plugin:Cache"},
                      {"ablate_exits_plugin": "import sys\nsys.exit(0)\n"})
    listing = run_cli(site, tmp_path, "plugins")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.split("\n\n")[0].splitlines()[1:]           # then the engines
    rows = {tuple(line.split()[:2]): line.rstrip().split(None, 4)[2:] for line in lines}
    assert rows[("kv_cache", "exits")] == ["ablate-exits", "0.3",
                                           "error: SystemExit: it calls sys.exit(0) when imported"]
    for (slot, name), source in BUILT_INS.items():
        assert rows[(slot, name)][0::2] == [source, "loaded"]
    assert ("ablate: plugin 'kv_cache.exits' (ablate_exits_plugin:Cache, from ablate-exits 0.3) could not be loaded "
            "and is skipped: SystemExit") in listing.stderr
    run = run_cli(site, tmp_path, "kv_cache=exits", f"results_dir={tmp_path / 'results'}", *TINY_RUN)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "kv_cache.exits from ablate-exits is error: SystemExit: it calls sys.exit(0) when imported" in run.stderr
    assert not (tmp_path / "results").exists()


OTHER_CONTIGUOUS = """
from ablate_kv_cache.contiguous import ContiguousKVCache


class OtherContiguous(ContiguousKVCache):
    \"\"\"Another package's cache that is also called `contiguous`.\"\"\"
"""


@pytest.mark.slow
def test_cli_refuses_an_ambiguous_plugin_until_one_is_blocked(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "other-kv", "1.5", {"kv_cache.contiguous": "ablate_other_kv:OtherContiguous"},
                      {"ablate_other_kv": OTHER_CONTIGUOUS})
    results = tmp_path / "results"
    refused = run_cli(site, tmp_path, "kv_cache=contiguous", f"results_dir={results}", *TINY_RUN)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert line == ("error: kv_cache=contiguous is ambiguous: supplied by ablate-kv-cache 0.1.0 "
                    "(ablate_kv_cache.contiguous:ContiguousKVCache) and other-kv 1.5 "
                    "(ablate_other_kv:OtherContiguous); keep one by blocking the others, e.g. "
                    "ABLATE_BLOCK_PLUGINS=other-kv:kv_cache.contiguous keeps "
                    "ablate-kv-cache's, or uninstall one")
    assert not results.exists()
    # an arm that does not choose it runs as usual
    assert run_cli(site, tmp_path, "kv_cache=dynamic", f"results_dir={results}", *TINY_RUN).returncode == 0
    chosen = run_cli(site, tmp_path, "kv_cache=contiguous", f"results_dir={results}", *TINY_RUN,
                     env={"ABLATE_BLOCK_PLUGINS": "other-kv:kv_cache.contiguous"})
    assert chosen.returncode == 0, chosen.stderr[-2000:]
    (environment,) = [p for p in results.rglob("environment.json")
                      if json.loads((p.parent / "config.json").read_text())["kv_cache"]["name"] == "contiguous"]
    packages = json.loads(environment.read_text())["measured_inputs"]["plugin_packages"]
    assert packages["ablate-kv-cache"]["version"] == "0.1.0"
    assert packages["ablate-kv-cache"]["plugins"] == ["kv_cache.contiguous"]
