"""Does everything the CLI and benchmarks/gpu_check.py import, import here? One line per missing
package, with the name pip knows it by, in seconds: before a GPU node spends minutes finding out
one import at a time (setup.sh runs it last; gpu_check runs it as its first section).

    python -m ablate.preflight        # exit 0: all present; 1: a line per missing package

Only the standard library is imported at module level, so that this runs where nothing else does.
tests/test_gpu_check.py checks that every import in ablate/, the kernels, the plugins and gpu_check
is listed here (or is ablate's own).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

# import name: (pip name, what needs it). Importing them is the check: a package that is present but
# whose own dependency is missing (omegaconf without antlr4) fails too, and names that dependency.
REQUIRED = {
    "torch": ("torch", "the engine"),
    "triton": ("triton", "the attention kernels (ablate_kernels)"),
    "numpy": ("numpy", "metrics"),
    "pandas": ("pandas", "results tables"),
    "scipy": ("scipy", "confidence intervals (ablate/analysis/stats.py)"),
    "psutil": ("psutil", "process memory and CPU contention"),
    "tqdm": ("tqdm", "progress bars (ablate/experiment/run.py)"),
    "matplotlib": ("matplotlib", "report plots"),
    "tabulate": ("tabulate", "Markdown tables in reports (pandas.DataFrame.to_markdown)"),
    "yaml": ("pyyaml", "configs"),
    "hydra": ("hydra-core==1.3.2", "the CLI"),
    "omegaconf": ("omegaconf==2.3.0", "the CLI"),
    "antlr4": ("antlr4-python3-runtime==4.9.3", "omegaconf's interpolations"),
    "tokenizers": ("tokenizers", "tokenizers, imported by the CLI even for random weights"),
    "gguf": ("gguf==0.19.0", "GGUF checkpoints, imported by the checkpoint loader"),
    # ablate's own: installed by setup.sh (pip install -e . -e kernels -e plugins/*)
    "ablate.cli": ("-e .", "the CLI itself"),
    "ablate_kernels": ("-e kernels", "the Triton kernels"),
    "ablate_attention": ("-e plugins/attention", "attention plugins"),
    "ablate_kv_cache": ("-e plugins/kv_cache", "KV-cache plugins"),
    "ablate_scheduler": ("-e plugins/scheduler", "scheduler plugins"),
    "ablate_decoding": ("-e plugins/decoding", "decoding plugins"),
    "ablate_variants": ("-e plugins/variants", "model-variant plugins"),
    "ablate_streaming": ("-e plugins/streaming", "streaming plugins"),
}
# present in most setups, but a run goes on without them, saying what it left out
OPTIONAL = {
    "wandb": ("wandb", "W&B logging (a run says so in one line and logs nothing)"),
    "safetensors": ("safetensors", "Hugging Face checkpoints (model.path=...)"),
    "jinja2": ("jinja2", "chat templates of pretrained tokenizers"),
    "pynvml": ("nvidia-ml-py", "GPU clocks and ECC when nvidia-smi cannot answer"),
    "threadpoolctl": ("threadpoolctl", "numpy's BLAS threads matched to torch's on the CPU"),
    "pyarrow": ("pyarrow", "Parquet output of `python -m ablate collect`"),
    "joblib": ("joblib", "sweeps with hydra/launcher=joblib"),
    "hydra_plugins.hydra_joblib_launcher": ("hydra-joblib-launcher", "sweeps with hydra/launcher=joblib"),
    "hydra_plugins.hydra_submitit_launcher": ("hydra-submitit-launcher", "sweeps on SLURM"),
    "transformers": ("transformers", "the hf outside engine and the reference tests"),
    "llama_cpp": ("llama-cpp-python", "the llamacpp outside engine"),
}
# a missing module found only through another one's import (omegaconf -> antlr4): its pip name
PIP_NAMES = {name: pip for name, (pip, _) in (REQUIRED | OPTIONAL).items()} | {"nvidia": "nvidia-ml-py"}


def missing(modules: dict[str, tuple[str, str]], load: bool = True) -> list[str]:
    """One line per module of `modules` that does not import: the module that is missing (which may
    be a dependency of the one imported), its pip name, and what needs it. load=False only looks
    for each module (transformers alone would take seconds to import)."""
    lines = []
    for name, (pip, needed_by) in modules.items():
        try:
            if not load:
                if importlib.util.find_spec(name) is None:
                    raise ModuleNotFoundError(name=name)
                continue
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            lost = err.name or name
            if lost != name and lost.split(".")[0] != name.split(".")[0]:   # the import's own dependency
                pip = PIP_NAMES.get(lost.split(".")[0], lost.split(".")[0].replace("_", "-"))
                needed_by = f"{name}, for {needed_by}"
            lines.append(f"missing: {lost} (pip install {pip}), needed by {needed_by}")
        except Exception as err:    # noqa: BLE001  (present but broken: a failed native load, a bad version)
            lines.append(f"broken: {name} ({pip}) fails to import, needed by {needed_by}: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    return lines


def main() -> int:
    problems = missing(REQUIRED)
    for line in problems:
        print(f"preflight: {line}", file=sys.stderr)
    for line in missing(OPTIONAL, load=False):
        print(f"preflight (optional): {line}", file=sys.stderr)
    if problems:
        print(f"preflight: {len(problems)} of {len(REQUIRED)} required imports fail; offline, carry the wheels "
              "named above (docs/install.md: installing on a machine without a registry)", file=sys.stderr)
        return 1
    print(f"preflight: all {len(REQUIRED)} required imports work (python {sys.version.split()[0]}, {sys.executable})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
