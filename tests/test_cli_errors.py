"""A config error is one line on stderr and exit status 2, not a traceback (unless asked for one)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ablate(tmp_path: Path, *args: str, multirun: bool = False, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "ABLATE_DEBUG")} | env
    return subprocess.run([sys.executable, "-m", "ablate", *["-m"] * multirun, "model=tiny", "model.init=random", *args,
                           f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                           "hydra.output_subdir=null", f"results_dir={tmp_path / 'results'}", "wandb.mode=disabled"],
                          cwd=tmp_path, env=environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)


def test_a_config_error_is_one_line_and_exit_status_2(tmp_path):
    result = ablate(tmp_path, "experiment.repeats=0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: experiment.repeats must be >= 1, got 0"]
    assert not (tmp_path / "results").exists()


@pytest.mark.slow      # a CLI process (~5 s); the one-line error: test_a_config_error_is_one_line_and_exit_status_2
def test_debugging_keeps_the_traceback(tmp_path):
    result = ablate(tmp_path, "experiment.repeats=0", ABLATE_DEBUG="1")
    assert result.returncode != 0 and "ValueError" in result.stderr
    assert "experiment.repeats must be >= 1" in result.stderr
    assert not any(line.startswith("error:") for line in result.stderr.splitlines())


@pytest.mark.slow      # a CLI sweep of two jobs (~15 s)
def test_in_a_sweep_each_bad_job_says_which_it_is(tmp_path):
    result = ablate(tmp_path, "experiment.repeats=0,-1", multirun=True)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["[job 0] error: experiment.repeats must be >= 1, got 0",
                      "[job 1] error: experiment.repeats must be >= 1, got -1"], result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode == 1 and "sweep: 2 of 2 jobs did not finish" in result.stdout     # the sweep says so


@pytest.mark.slow      # a CLI process (~5 s); the message in-process: tests/test_bad_inputs.py
def test_an_unknown_plugin_option_lists_the_plugins_options(tmp_path):
    result = ablate(tmp_path, "kv_cache=paged", "kv_cache.blok_size=4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: kv_cache=paged has no option blok_size; its options are: block_size, budget_bytes, "
        "budget_fraction, budget_tokens, prefix_caching"]


# -- overrides Hydra would misread (issue 26): one line, exit 2, before Hydra runs ------------------------

@pytest.mark.parametrize("argv, says", [
    (["model=tiny,nonesuch"], "model=tiny,nonesuch: a comma outside brackets sweeps over values, which needs -m"),
    (["kv_cache=none,contiguous"], "needs -m"),
    (["experiment.name=café"], "experiment.name=café: non-ASCII characters must be quoted"),
    (["+experiment.grid.prompt=[naïve]"], "non-ASCII characters must be quoted"),
    (["-m", "experiment.name=ü,a"], "non-ASCII characters must be quoted"),
])
def test_an_override_hydra_would_misread_is_named_with_how_to_write_it(argv, says):
    from ablate.cli_overrides import override_problem
    assert says in override_problem(argv)


@pytest.mark.parametrize("argv", [
    ["-m", "model=tiny,smollm2-135m"], ["+experiment.grid.output_len=[4,8]"], ["experiment.name='a,b'"],
    ["experiment.name='café'"], ['+experiment.arms.x={kv_cache: contiguous, attention: sdpa}'],
    ["-m", "workload.prompt_len=range(8,33,8)"], ["hydra.sweeper.params={a: 1}"],
])
def test_overrides_hydra_reads_pass(argv):
    from ablate.cli_overrides import override_problem
    assert override_problem(argv) is None


def test_multirun_is_accepted_after_the_overrides():
    from ablate.cli_overrides import multirun_first
    assert multirun_first(["model=tiny", "-m", "kv_cache=a,b"]) == ["-m", "model=tiny", "kv_cache=a,b"]
    assert multirun_first(["model=tiny", "--multirun"]) == ["--multirun", "model=tiny"]
    assert multirun_first(["model=tiny"]) == ["model=tiny"]


@pytest.mark.slow      # a CLI process each (~5 s); the checks in-process: the tests of override_problem above
@pytest.mark.parametrize("args, says", [
    (["model=tiny,nonesuch"], "needs -m"),
    (["experiment.name=café"], "must be quoted"),
    (["experiment.name=${oops}"], "experiment.name: Interpolation key 'oops' not found"),
])
def test_they_are_one_line_and_exit_status_2(tmp_path, args, says):
    result = ablate(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line
