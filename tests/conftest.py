"""Shared fixtures: a tiny random model, engines built from arm specs, requests, composed configs.

Everything a test writes (results, W&B runs, Hydra outputs) goes under pytest's tmp_path, never
the repository's results/.
"""
from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("WANDB_CONSOLE", "off")      # wandb must not wrap pytest's captured stdout

from pathlib import Path
from typing import Any

import pytest
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry, default_registry
from ablate.measure.recorder import Recorder
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

REPO = Path(__file__).resolve().parent.parent

# Settings every composed config in the tests gets: the CPU, one thread, and given peaks (no
# machine measurement of several GiB, no write to ~/.cache/ablate).
FAST = ["device=cpu", "threads=1", "peak_bandwidth=1e10", "peak_flops=1e11"]


@pytest.fixture(scope="session", autouse=True)
def _wandb_home(tmp_path_factory):
    """W&B's own config, cache and artifact folders in a temporary folder, not in $HOME."""
    base = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(base / var.lower()))
        yield


@pytest.fixture(scope="session")
def registry() -> Registry:
    return default_registry()


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    """The `tiny` preset with seeded random weights, fp32 on the CPU (shared: never modified)."""
    return LlamaModel.random(preset("tiny"))


@pytest.fixture(scope="session")
def build(tiny_model, registry):
    """build(arm_spec, model=None, max_num_seqs=8, max_seq_len=64, record=True) -> BuiltArm.

    arm_spec as in an experiment's arms: {slot: plugin name | {name: ..., option: value}}; slots it
    does not name keep the baseline's plugin. With record=True, `built.recorder` is the Recorder
    hooked to the engine.
    """
    def _build(spec: dict[str, Any], model: LlamaModel | None = None, *, max_num_seqs: int = 8,
               max_seq_len: int = 64, record: bool = True) -> BuiltArm:
        arm = resolve_arm("test", spec, baseline_configs(registry), registry)
        recorders: list[Recorder] = []

        def hooks(kv_cache):
            if record:
                recorders.append(Recorder(kv_cache))
            return recorders

        built = build_arm(arm, model if model is not None else tiny_model, EngineConfig(max_num_seqs=max_num_seqs),
                          max_seq_len, registry, hooks)
        built.recorder = recorders[0] if recorders else None
        return built

    return _build


def prompt_tokens(length: int, seed: int, vocab_size: int = 256) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab_size, (length,), generator=gen).tolist())


@pytest.fixture
def fresh_product_paths():
    """The CPU product paths chosen afresh in the test (PRODUCT_PATHS.reset: nothing chosen or forced,
    and only the layers the test makes timed over); the process's choices come back after it."""
    from ablate.model.product_paths import PRODUCT_PATHS

    saved = PRODUCT_PATHS.snapshot()
    PRODUCT_PATHS.reset(layers=True)
    yield PRODUCT_PATHS
    PRODUCT_PATHS.restore(saved)


@pytest.fixture(scope="session")
def make_requests():
    """make_requests(prompt_lens, max_new_tokens, sampling=None, stop_token_ids=(), seed=0, first_id=0).

    Request i gets prompt_lens[i] seeded random tokens (the same for the same seed and index) and
    max_new_tokens[i] (or max_new_tokens for all); `sampling` is one SamplingParams or a list.
    """
    def _make(prompt_lens: list[int], max_new_tokens: int | list[int], *,
              sampling: SamplingParams | list[SamplingParams] | None = None,
              stop_token_ids: tuple[int, ...] | list[tuple[int, ...]] = (), seed: int = 0,
              first_id: int = 0, vocab_size: int = 256) -> list[Request]:
        n = len(prompt_lens)
        max_new = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        stops = stop_token_ids if isinstance(stop_token_ids, list) else [tuple(stop_token_ids)] * n
        return [Request(first_id + i, prompt_tokens(length, seed * 1000 + i, vocab_size), max_new[i],
                        samplings[i], tuple(stops[i]))
                for i, length in enumerate(prompt_lens)]

    return _make


@pytest.fixture(scope="session")
def compose_config(registry):
    """compose_config(tmp_path, *overrides) -> the plain dict the CLI hands to run_job.

    Composed by Hydra's compose API from the repository's conf/ exactly as `python -m ablate`
    does, with results_dir and wandb.dir under tmp_path.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ablate.engine.config_store import register_configs

    register_configs(registry)

    def _compose(tmp_path: Path, *overrides: str) -> dict[str, Any]:
        base = [f"results_dir={tmp_path / 'results'}", f"wandb.dir={tmp_path / 'wandb'}", *FAST]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*base, *overrides])
        return OmegaConf.to_container(cfg, resolve=True)

    return _compose
