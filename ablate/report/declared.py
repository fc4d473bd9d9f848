"""What the arms' plugins declare about their stats and figures, stored with every run
(plugin_stats.json) so that a report can be drawn again without the plugins installed."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ablate.api.plugin import Stat, StatFigure

FILE = "plugin_stats.json"


@dataclass
class Declarations:
    stats: dict[str, Stat] = field(default_factory=dict)                 # `slot.key` column -> Stat
    figures: list[tuple[str, StatFigure]] = field(default_factory=list)  # (slot, figure)

    @classmethod
    def of(cls, plugin_classes) -> Declarations:
        """From plugin classes (each with .slot, .reported_stats, .figures)."""
        out = cls()
        for plugin in plugin_classes:
            slot = plugin.slot.value
            for stat in plugin.reported_stats:
                out.stats.setdefault(f"{slot}.{stat.key}", stat)
            for figure in plugin.figures:
                if all(f.name != figure.name for _, f in out.figures):
                    out.figures.append((slot, figure))
        return out

    def column(self, slot: str, key: str) -> str:
        """A figure's name for a column: `slot.key` for the plugin's stats, else the results column."""
        return f"{slot}.{key}" if f"{slot}.{key}" in self.stats else key

    def to_json(self) -> str:
        return json.dumps({"stats": {k: asdict(s) for k, s in self.stats.items()},
                           "figures": [{"slot": slot, **asdict(f)} for slot, f in self.figures]}, indent=1)

    @classmethod
    def load(cls, run_dir: Path) -> Declarations:
        path = Path(run_dir) / FILE
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        figures = []
        for f in raw.get("figures", []):
            slot = f.pop("slot")
            figures.append((slot, StatFigure(**{**f, "series": tuple(f["series"])})))
        return cls({k: Stat(**s) for k, s in raw.get("stats", {}).items()}, figures)
