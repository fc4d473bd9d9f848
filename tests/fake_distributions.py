"""Installed distributions made without an installer: a `.dist-info` folder (METADATA, entry_points.txt)
beside the distribution's modules, which importlib.metadata finds as it finds any other once the folder
is on sys.path (or PYTHONPATH, for a command-line run)."""
from __future__ import annotations

import textwrap
from importlib.metadata import PathDistribution
from pathlib import Path

PLUGINS = "ablate.plugins"


def fake_distribution(site: Path, name: str, version: str, entry_points_: dict[str, str],
                      modules: dict[str, str] | None = None, group: str = PLUGINS) -> PathDistribution:
    """Distribution `name` `version` in folder `site`, declaring `entry_points_` (name -> module:attr) in
    `group`, with `modules` (import name -> the code of its __init__.py)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points_.items()))
    for module, code in (modules or {}).items():
        (site / module).mkdir()
        (site / module / "__init__.py").write_text(textwrap.dedent(code))
    return PathDistribution(info)
