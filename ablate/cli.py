"""`python -m ablate ...`: Hydra composes the config and runs a job (or a sweep with -m).

`python -m ablate plugins` lists the plugins found; `python -m ablate compare <run> <run>` compares
two result folders.
"""
from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from ablate.engine.registry import conf_dir, default_registry, register_configs


def list_plugins() -> None:
    rows = default_registry().table()
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("slot", "name", "source", "status")}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in widths.items()))


def main() -> None:
    if sys.argv[1:2] == ["plugins"]:
        list_plugins()
        return
    if sys.argv[1:2] == ["compare"]:
        from ablate.report.compare import main as compare
        compare(sys.argv[2:])
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
        run_job(raw, registry, swallow_errors=sweeping)

    job()


if __name__ == "__main__":
    main()
