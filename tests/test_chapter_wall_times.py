"""benchmarks/chapter_wall_times.py: the command each chapter runs, the report it printed, and a
failed run recorded with its last stderr line."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "chapter_wall_times.py"
spec = importlib.util.spec_from_file_location("chapter_wall_times", PATH)
walls = importlib.util.module_from_spec(spec)
sys.modules["chapter_wall_times"] = walls       # dataclasses look their module up while it loads
spec.loader.exec_module(walls)


def test_every_chapter_is_an_experiment_and_unknown_names_are_refused():
    assert walls.experiment_names(None) == list(walls.CHAPTERS)
    assert walls.experiment_names(["ch10_textbook"]) == ["ch10_textbook"]
    with pytest.raises(ValueError, match=r"--only: no experiment named ch99_nothing; known: .*ch10_textbook"):
        walls.experiment_names(["ch10_textbook", "ch99_nothing"])


def test_the_command_writes_outside_results_and_is_shown_as_a_reader_types_it(tmp_path):
    command = walls.command_for("ch09_paged", tmp_path, ["device=cpu"])
    assert command[1:5] == ["-m", "ablate", "+experiment=ch09_paged", "redo=true"]
    assert f"results_dir={tmp_path}" in command and f"hydra.run.dir={tmp_path / 'hydra' / 'ch09_paged'}" in command
    assert walls.shown(command) == "python -m ablate +experiment=ch09_paged redo=true device=cpu"


def test_the_report_is_the_last_report_line_and_none_when_none_was_written():
    out = "results: /r/x\n[job 0] report: /r/x/report.md\nW&B run: /r/x/wandb\n"
    assert walls.report_path(out) == "/r/x/report.md"
    assert walls.report_path("\nreport: None\n") == "" and walls.report_path("no report here") == ""


@pytest.mark.slow      # one `python -m ablate` start-up: about 5 s
def test_a_failed_experiment_is_recorded_with_its_last_stderr_line(tmp_path):
    timing = walls.time_one("ch07_costs", tmp_path, ["workload.rate=-1"], timeout_s=120)
    assert timing.status == "failed (exit 2)" and timing.report == ""
    assert timing.error.startswith("error: workload.rate must be a finite number > 0"), timing.error
    assert (tmp_path / "logs" / "ch07_costs.stderr").read_text().strip().endswith(timing.error)
    walls.write_tables(tmp_path / "out", [timing], ["workload.rate=-1"])
    table = (tmp_path / "out" / "chapter_wall_times.md").read_text()
    assert "| ch07_costs | `python -m ablate +experiment=ch07_costs redo=true workload.rate=-1` |" in table
    assert (tmp_path / "out" / "chapter_wall_times.csv").read_text().startswith(
        "experiment,command,seconds,status,report,error\n")
