"""What a job prints: its lines prefixed with the job's number in a sweep, so that the output of
`python -m ablate -m ...` says which job each line is from."""
from __future__ import annotations


def job_prefix() -> str:
    """'[job N] ' inside a Hydra multirun (N = hydra.job.num), '' in a single run, outside Hydra, or
    when Hydra's config cannot be read."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return ""
        hydra = HydraConfig.get()
        if hydra.mode != RunMode.MULTIRUN:
            return ""
        return f"[job {hydra.job.num}] "
    except Exception:
        return ""
