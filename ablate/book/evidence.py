"""What the measured claims read: the latest finished run of each chapter experiment, and a few
quick measurements on this machine (each made at most once per book run, only with book.measure).

A chapter experiment's figures are read, never re-measured here: the claim names the run folder it
read and the command that measures it again. Without a finished run the claim says "not run".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd
import torch

from ablate.results import DONE, load, runs_under


@dataclass(frozen=True)
class StoredRun:
    """A chapter experiment's finished run, as the claims read it."""

    path: Path
    config: dict
    summary: pd.DataFrame
    requests: pd.DataFrame

    @property
    def label(self) -> str:
        """Where the figures come from: the folder and the model they were measured on."""
        model = self.config.get("model") or {}
        return f"{self.path} ({model.get('name', '?')}, {model.get('dtype', '?')}, {model.get('init', '?')} weights)"

    def rows(self, arm: str) -> pd.DataFrame:
        """The summary rows of one arm, one per grid point."""
        return self.summary[self.summary["arm"] == arm]

    def point(self, row: pd.Series) -> str:
        """A summary row's grid point, e.g. 'rate=4.0'."""
        return ", ".join(f"{k}={row[k]}" for k in (self.config.get("experiment") or {}).get("grid", {}))

    def arm(self, name: str, **point) -> pd.Series | None:
        """The summary row of one arm at a grid point (every grid key given), or None."""
        rows = self.summary[self.summary["arm"] == name]
        for key, value in point.items():
            rows = rows[rows[key] == value]
        return None if rows.empty else rows.iloc[0]


class Evidence:
    """Lazily gathered figures for the measured claims; `measure=False` makes no measurement."""

    VERIFY_MODEL, VERIFY_CONTEXT, VERIFY_KS, VERIFY_ROUNDS = "smollm2-135m", 256, (1, 2, 4, 8, 16), 3

    def __init__(self, runs_dir: str | Path, measure: bool, device: torch.device | None = None) -> None:
        self.runs_dir = Path(runs_dir)
        self.measure = measure
        self.device = device or torch.device("cpu")
        self._runs: dict[str, StoredRun | None] = {}

    def run(self, experiment: str) -> StoredRun | None:
        """The most recently finished run of `experiment` under runs_dir, or None."""
        if experiment not in self._runs:
            self._runs[experiment] = _latest(self.runs_dir / experiment)
        return self._runs[experiment]

    @cached_property
    def peaks(self):
        """This machine's measured peak bandwidth and FLOP/s (fp32), or None without measuring."""
        from ablate.measure import hardware
        if not self.measure:
            return None
        try:
            return hardware.peaks(self.device, torch.float32)
        except hardware.PeaksUnavailable:
            return None

    @cached_property
    def onchip(self):
        """Copy bandwidth of a cache-resident buffer and of one in DRAM (ablate.analysis.onchip), or None."""
        if not self.measure:
            return None
        from ablate.analysis.onchip import measure_this_machine
        return measure_this_machine()

    @cached_property
    def verify(self) -> pd.DataFrame | None:
        """A verify pass of k + 1 tokens against a one-token step (ablate.measure.verify_cost), on
        SmolLM2-135M's shape with random weights (time does not depend on their values), or None."""
        if not self.measure:
            return None
        from ablate.measure.verify_cost import verify_cost
        from ablate.model.presets import preset
        from ablate.model.llama import LlamaModel
        model = LlamaModel.random(preset(self.VERIFY_MODEL, dtype="fp32", init="random"), self.device)
        return verify_cost(model, context=self.VERIFY_CONTEXT, ks=self.VERIFY_KS, rounds=self.VERIFY_ROUNDS, passes_per_round=2,
                           peaks=self.peaks)

    @property
    def verify_label(self) -> str:
        return (f"measured now: {self.VERIFY_MODEL} (random weights, fp32) after {self.VERIFY_CONTEXT} tokens, "
                f"{self.VERIFY_ROUNDS} rounds, on {self.device.type}")


def _latest(folder: Path) -> StoredRun | None:
    finished = runs_under(folder) if folder.is_dir() else []      # done.json is written only by a finished run
    for path in sorted(finished, key=lambda p: (p / DONE).stat().st_mtime, reverse=True):
        try:
            res = load(path)
        except (OSError, ValueError):
            continue                        # unreadable: the next most recent
        if not res.summary.empty:
            return StoredRun(path, res.config, res.summary, res.requests)
    return None

