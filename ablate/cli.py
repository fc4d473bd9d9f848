"""`python -m ablate ...`: Hydra composes the config and runs a job (or a sweep with -m).

`python -m ablate plugins` lists the plugins found; `python -m ablate compare <run> <run>` compares
two result folders; `python -m ablate collect results/<experiment> [--out DIR]` joins every job of a
sweep into sweep_runs/sweep_summary tables (CSV and Parquet) and a sweep report.
"""
from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, OmegaConf

from ablate.engine.registry import conf_dir, default_registry, register_configs


def list_plugins() -> None:
    rows = default_registry().table()
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("slot", "name", "source", "status")}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in widths.items()))


def _debugging() -> bool:
    """HYDRA_FULL_ERROR=1 or ABLATE_DEBUG=1: errors keep their tracebacks."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("ABLATE_DEBUG") == "1"


def config_error(raw: dict, registry) -> str | None:
    """The config's validation error (to_run_config and make_plan name the option), on one line,
    or None when the config is valid."""
    from ablate.experiment.config import to_run_config
    from ablate.experiment.plan import make_plan

    try:
        make_plan(to_run_config(raw, registry), registry)
    except ValueError as err:
        return " ".join(str(err).split())
    return None


def main() -> None:
    if sys.argv[1:2] == ["plugins"]:
        list_plugins()
        return
    if sys.argv[1:2] == ["compare"]:
        from ablate.report.compare import main as compare
        compare(sys.argv[2:])
        return
    if sys.argv[1:2] == ["collect"]:
        from ablate.report.collect import main as collect
        collect(sys.argv[2:])
        return
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ablate.experiment.job import run_job

    registry = default_registry()
    register_configs(registry)

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        raw = OmegaConf.to_container(cfg, resolve=True)
        sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
        if not _debugging() and (message := config_error(raw, registry)) is not None:
            from ablate.report.console import job_prefix
            print(f"{job_prefix()}error: {message}", file=sys.stderr, flush=True)
            if sweeping:        # a sweep goes on with its other jobs
                return
            sys.exit(2)         # SystemExit passes through Hydra's handler: no traceback
        run_job(raw, registry, swallow_errors=sweeping, job_dir=HydraConfig.get().runtime.output_dir)

    job()


if __name__ == "__main__":
    main()
