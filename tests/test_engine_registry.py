"""Outside engines found through entry points (ablate/outside/discovery.py): a package that leaves at
import, or two packages declaring one engine name, are refused naming the package, never a silent exit
or a silent pick."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import ablate.outside.discovery as engines
from ablate.cli import outside_engines
from ablate.outside.contract import HOW_TO_DECLARE
from ablate.outside.hf import HFGenerate
from fake_distributions import fake_distribution

HF_CLASS = "ablate.outside.hf:HFGenerate"


def with_distributions(monkeypatch, *dists) -> None:
    real = list(entry_points(group=engines.GROUP))
    extra = [ep for dist in dists for ep in dist.entry_points.select(group=engines.GROUP)]
    monkeypatch.setattr(engines, "entry_points", lambda group: [*real, *extra] if group == engines.GROUP else [])


@pytest.mark.parametrize("code, what", [
    ("import sys\nsys.exit(0)\n", "SystemExit: it calls sys.exit(0) when imported"),
    ("raise SystemExit('needs a GPU')\n", "SystemExit: it calls sys.exit('needs a GPU') when imported"),
    ("class Abort(BaseException):\n    pass\nraise Abort('stop')\n", "Abort: stop"),
    ("raise ImportError('no libfast')\n", "ImportError: no libfast"),
])
def test_an_engine_package_leaving_at_import_is_refused_naming_it(code, what, tmp_path, monkeypatch):
    module = f"ablate_leaving_engine_{abs(hash(code))}"
    fake_distribution(tmp_path, "fast-engine", "0.2", {"fast": f"{module}:Fast"}, {module: code}, group=engines.GROUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        engines.load_engine("arm 'f'", "fast")
    assert str(err.value) == f"arm 'f': engine 'fast' ({module}:Fast from fast-engine 0.2) failed to load: {what}"
    listing = outside_engines()            # `python -m ablate plugins` goes on, the others listed
    assert listing["fast"] == f"error: {err.value}".replace("arm 'f'", "ablate plugins")
    assert {"hf", "openai"} <= set(listing)


def test_two_packages_declaring_one_engine_name_are_refused_naming_both(tmp_path, monkeypatch):
    rival = fake_distribution(tmp_path, "other-hf", "3.0", {"hf": "other_hf:Generate"}, group=engines.GROUP)
    with_distributions(monkeypatch, rival)
    with pytest.raises(ValueError, match=r"^arm 'h': engine 'hf' is ambiguous: declared by "
                                         r"ablate\.outside\.hf:HFGenerate from ablate 0\.1\.0 and "
                                         r"other_hf:Generate from other-hf 3\.0; uninstall all but one$"):
        engines.load_engine("arm 'h'", "hf")
    assert engines.engine_names().count("hf") == 1


def test_one_engine_declared_twice_by_one_class_is_not_ambiguous(tmp_path, monkeypatch):
    """An editable install beside a regular one of the same package."""
    again = fake_distribution(tmp_path, "ablate", "0.1.0", {"hf": HF_CLASS}, group=engines.GROUP)
    with_distributions(monkeypatch, again)
    assert engines.load_engine("arm 'h'", "hf") is HFGenerate


OLD_ENGINE = '''
from ablate.outside.batches import OneBatchAtATime
{imports}

{config}
class Old(OneBatchAtATime):
    name = "old"
    {declaration}
'''


@pytest.mark.parametrize("imports, config, declaration, says", [
    ("from ablate.outside.contract import Option", "",              # written against the `options` dict of Option
     "options = {'step_s': Option(0.02, 'seconds per token')}",
     f"failed to load: ImportError: ablate.outside.contract.Option is gone: {HOW_TO_DECLARE}"),
    ("", "", "options = {'step_s': 0.02}", f"declares `options`, which ablate no longer reads: {HOW_TO_DECLARE}"),
    ("from dataclasses import dataclass",
     "@dataclass\nclass OldConfig:\n    step_s: float = 0.02\n", "config_class = OldConfig",
     f"has config_class OldConfig, which is not a dataclass deriving from OutsideEngineConfig: {HOW_TO_DECLARE}"),
    ("from dataclasses import dataclass\nfrom ablate.outside.contract import OutsideEngineConfig",
     "@dataclass\nclass OldConfig(OutsideEngineConfig):\n    step_s: float = 0.02\n", "config_class = OldConfig",
     "has config_class OldConfig, whose name defaults to '', not 'old'"),
])
def test_an_engine_not_declaring_a_config_class_is_refused_at_load_saying_how(imports, config, declaration, says,
                                                                                  tmp_path, monkeypatch):
    module = f"ablate_old_engine_{abs(hash((imports, config, declaration)))}"
    code = OLD_ENGINE.format(imports=imports, config=config, declaration=declaration)
    fake_distribution(tmp_path, "old-engine", "0.1", {"old": f"{module}:Old"}, {module: code}, group=engines.GROUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        engines.load_engine("arm 'o'", "old")
    message = str(err.value)
    assert message.startswith(f"arm 'o': engine 'old' ({module}:Old from old-engine 0.1) "), message
    assert message.endswith(says) and "\n" not in message
    assert outside_engines()["old"] == f"error: {message}".replace("arm 'o'", "ablate plugins")


def test_an_engine_without_options_may_leave_config_class_out(tmp_path, monkeypatch):
    from ablate.engine.arm import Arm
    from ablate.outside.contract import OutsideEngineConfig

    code = OLD_ENGINE.format(imports="", config="", declaration="def generate(self, batch, emit):\n        pass")
    fake_distribution(tmp_path, "plain-engine", "0.1", {"old": "ablate_plain_engine:Old"},
                      {"ablate_plain_engine": code}, group=engines.GROUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = engines.load_engine("arm 'p'", "old")
    config = cls.resolve_options("arm 'p'.engine", {})
    assert config == OutsideEngineConfig(name="old") and Arm("p", {}, outside=(cls, config)).label() == "engine=old"
    with pytest.raises(ValueError, match=r"^arm 'p'\.engine: engine=old has no option threads; its options: none$"):
        cls.resolve_options("arm 'p'.engine", {"threads": 2})
