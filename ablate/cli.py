"""`python -m ablate ...`: Hydra composes the config and runs a job (or a sweep with -m).

`python -m ablate plugins` lists the plugins found; `python -m ablate book [section=7.3]` prints the
chapter's claims with the project's figures and verdicts; `python -m ablate compare <run> <run>` compares
two result folders; `python -m ablate collect results/<experiment> [--out DIR]` joins every job of a
sweep into sweep_runs/sweep_summary tables (CSV and Parquet) and a sweep report; `python -m ablate repro
[--processes N] <overrides...>` runs one experiment in N fresh processes and says whether their speedups agree.
"""
from __future__ import annotations

import os
import sys
import warnings

from ablate import process_env
from ablate.measure import cpu_policy

# Before torch and numpy load (the registry imports them), since each reads its setting only then:
# large CPU tensors on huge pages (PyTorch's allocator, at its first allocation: a decode step streams
# every weight once), numpy's OpenBLAS workers' spinning bounded (when numpy loads: one-row steps lent
# to numpy's BLAS must not leave its workers spinning into torch's next step), and how OpenMP's threads
# wait (when torch loads it). What the environment sets wins; every run records them (environment.json:
# process_env, cpu_policy). ablate/process_env.py says more; `import ablate` itself sets nothing.
process_env.apply()
cpu_policy.prepare()

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from ablate.engine.config_store import register_configs, unknown_option  # noqa: E402
from ablate.engine.registry import conf_dir, default_registry  # noqa: E402


def list_plugins() -> None:
    rows = default_registry().table()
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("slot", "name", "source", "version", "status")}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in widths.items()))
    print("\noutside engines (an arm's engine: {name: ..., <option>: <value>}):")
    for name, (line, options) in _outside_engines().items():
        print(f"  {name.ljust(10)}{line}")
        for option in options:
            print(f"  {'':10}  {option}")


def outside_engines() -> dict[str, str]:
    """Each outside engine of the `ablate.engines` entry points: ready, or why not (what to install)."""
    return {name: line for name, (line, _) in _outside_engines().items()}


def _outside_engines() -> dict[str, tuple[str, list[str]]]:
    """Each outside engine: ready or why not, and its options as an arm writes them, `cache: str =
    "dynamic"  <its help>` (its config_class's fields); none for an engine that does not load."""
    import json

    from ablate.outside.discovery import engine_names, load_engine

    engines = {}
    for name in engine_names():
        try:
            cls = load_engine("ablate plugins", name)
        except ValueError as err:
            engines[name] = (f"error: {err}", [])
            continue
        options = [f"{f.name}: {f.type} = {json.dumps(f.default, default=repr)}  {f.metadata.get('help', '')}".rstrip()
                   for f in cls.config_class.options()]
        engines[name] = (cls.missing() or "ready", options)
    return engines


def book_arguments(args: list[str]) -> list[str]:
    """`book section=7.3 measure=false` -> Hydra's `+experiment=book redo=true book.section=7.3 ...`:
    the book's own options may be given bare; it is always computed afresh (it reads the latest runs)."""
    from ablate.book.config import BookConfig
    own = set(BookConfig.__dataclass_fields__)
    return ["+experiment=book", "redo=true",
            *(f"book.{a}" if a.split("=", 1)[0] in own else a for a in args)]


def _debugging() -> bool:
    """HYDRA_FULL_ERROR=1 or ABLATE_DEBUG=1: errors keep their tracebacks."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("ABLATE_DEBUG") == "1"


def main() -> None:
    """Every failure ends in one line on stderr (the traceback only with ABLATE_DEBUG=1 or
    HYDRA_FULL_ERROR=1): status 2 for bad input (config, files, options), 1 for anything else, 130
    when interrupted; a job's failure is also recorded in its run folder (failed.json). A warning is
    one line too (ablate.report.console.warning), unless debugging."""
    if not _debugging():
        from ablate.report.console import show_warning
        warnings.showwarning = show_warning
    try:
        _main()
    except KeyboardInterrupt:
        _fail("interrupted: the rounds finished so far are kept in the run folder; the same command continues them",
              130)
    except (ValueError, OSError, LookupError) as err:      # bad input: an option, a file, a folder
        if _debugging():
            raise
        _fail(f"error: {_one_line(err)}", 2)
    except Exception as err:
        if _debugging():
            raise
        _fail(f"error: {type(err).__name__}: {_one_line(err)} (ABLATE_DEBUG=1 shows the traceback)", 1)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _fail(message: str, status: int) -> None:
    from ablate.report.console import job_prefix
    print(f"{job_prefix()}{message}", file=sys.stderr, flush=True)
    sys.exit(status)


def _main() -> None:
    if sys.argv[1:2] == ["plugins"]:
        list_plugins()
        return
    if sys.argv[1:2] == ["compare"]:
        from ablate.report.compare import main as compare
        compare(sys.argv[2:])
        return
    if sys.argv[1:2] == ["book"]:
        sys.argv[1:] = book_arguments(sys.argv[2:])
    if sys.argv[1:2] == ["collect"]:
        from ablate.report.collect import main as collect
        collect(sys.argv[2:])
        return
    if sys.argv[1:2] == ["repro"]:
        from ablate.report.repro import main as repro
        repro(sys.argv[2:])
        return
    import hydra
    from omegaconf.errors import OmegaConfBaseException
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ablate.experiment.baseline_failure import recorded_baseline_failure
    from ablate.cli_overrides import interpolation_error, multirun_first, override_problem
    from ablate.experiment.job import run_job
    from ablate.experiment.job_process import run_sweep_job
    from ablate.experiment.sweep_callbacks import FAILED_JOBS

    sys.argv[1:] = multirun_first(sys.argv[1:])
    if not _debugging() and (message := override_problem(sys.argv[1:])) is not None:
        _fail(f"error: {message}", 2)     # before Hydra's lexer or its "ambiguous value" block
    registry = default_registry()
    register_configs(registry)
    if not _debugging() and (message := unknown_option(registry, sys.argv[1:])) is not None:
        _fail(f"error: {message}", 2)     # before Hydra's own, less helpful message
    failure: list[BaseException] = []
    compared_nothing: list[str] = []

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        try:
            raw = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as err:     # ${oops}: an interpolation naming no option
            failure.append(ValueError(interpolation_error(err)))
            return
        job_dir = HydraConfig.get().runtime.output_dir
        if HydraConfig.get().mode == RunMode.MULTIRUN:    # a process per job: one killed by a signal fails alone
            run_sweep_job(raw, HydraConfig.get(), job_dir, _debugging())
            return
        try:
            folder = run_job(raw, registry, job_dir=job_dir)
        except Exception as err:     # raised before measuring (a config error, a locked folder), or while measuring
            if _debugging():
                raise
            failure.append(err)       # re-raised outside Hydra, which would print its traceback; main says it
            return
        if (why := recorded_baseline_failure(folder.path)) is not None:
            compared_nothing.append(f"{why}; its rows and reasons are in {folder.path}")

    job()
    if failure:
        raise failure[0]
    if compared_nothing:
        _fail(f"error: {compared_nothing[0]}", 1)
    if FAILED_JOBS:           # a sweep with failed jobs: the summary was printed by SweepOutcome
        sys.exit(1)


if __name__ == "__main__":
    main()
