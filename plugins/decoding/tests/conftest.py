"""Fixtures for the speculative decoding tests: tiny random models and engines built from arm specs."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import BuiltArm, baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import Registry, default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

# two shared cores: one thread each is fastest for tiny matmuls


@pytest.fixture(scope="session")
def registry() -> Registry:
    return default_registry()


@pytest.fixture(scope="session")
def target() -> LlamaModel:
    """tiny with 4 layers, so that early exit and layer skipping leave some out."""
    return LlamaModel.random(preset("tiny", n_layers=4))


@pytest.fixture(scope="session")
def build(registry):
    """build(spec, model, max_num_seqs=8, max_seq_len=64, **engine) -> BuiltArm; spec as an
    experiment's arm, engine: more EngineConfig fields."""
    def _build(spec: dict[str, Any], model: LlamaModel, *, max_num_seqs: int = 8,
               max_seq_len: int = 64, **engine: Any) -> BuiltArm:
        arm = resolve_arm("test", spec, baseline_configs(registry), registry)
        return build_arm(arm, model, EngineConfig(max_num_seqs=max_num_seqs, **engine), max_seq_len, registry)
    return _build


def repeating_prompt(length: int, seed: int, vocab_size: int = 256) -> tuple[int, ...]:
    """A random phrase repeated: the n-gram drafter has something to find."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab_size, (5,), generator=gen).tolist()
    return tuple((phrase * (length // 5 + 1))[:length])


@pytest.fixture(scope="session")
def make_requests():
    """make_requests(prompt_lens, max_new, sampling=greedy, stop_token_ids=()) -> requests 0, 1, ..."""
    def _make(prompt_lens: list[int], max_new: list[int], *, sampling: SamplingParams = SamplingParams(),
              stop_token_ids: tuple[int, ...] = ()) -> list[Request]:
        return [Request(i, repeating_prompt(n, i), m, sampling, stop_token_ids)
                for i, (n, m) in enumerate(zip(prompt_lens, max_new))]
    return _make
