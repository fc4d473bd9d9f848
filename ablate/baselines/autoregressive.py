"""decoding=autoregressive: one forward pass, one token per sequence."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api.step import Batch
from ablate.api.context import BuildContext
from ablate.api.slots import Decoding
from ablate.api.plugin import PluginConfig
from ablate.engine.runner import ModelRunner
from ablate.api.sampling import Sampler


@dataclass
class AutoregressiveConfig(PluginConfig):
    name: str = "autoregressive"
    seed: int = 0        # seeds requests that carry no seed of their own


class Autoregressive(Decoding):
    name = "autoregressive"
    config_class = AutoregressiveConfig

    def __init__(self, config: AutoregressiveConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.sampler = Sampler(config.seed)

    def step(self, runner: ModelRunner, batch: Batch) -> dict[int, list[int]]:
        logits, rows = runner.forward(batch)                 # (N, V), N = sequences that emit
        emitting = [seq for seq, r in zip(batch.seqs, rows) if r]
        tokens = self.sampler.sample(logits, emitting)
        return {seq.seq_id: [tok] for seq, tok in zip(emitting, tokens)}
