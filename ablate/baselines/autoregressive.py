"""decoding=autoregressive: one forward pass, one token per sequence."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.api import Batch, BuildContext, Decoding, Executor, PluginConfig, Sampler


@dataclass
class AutoregressiveConfig(PluginConfig):
    name: str = "autoregressive"
    seed: int = 0        # seeds requests that carry no seed of their own

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"decoding.seed must be >= 0, got {self.seed}")


class Autoregressive(Decoding):
    name = "autoregressive"
    config_class = AutoregressiveConfig

    def __init__(self, config: AutoregressiveConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.sampler = Sampler(config.seed)

    def step(self, executor: Executor, batch: Batch) -> dict[int, list[int]]:
        out = executor.forward(batch)                     # logits (N, V), N = sequences that emit
        emitting = [seq for seq, emits in zip(batch.seqs, batch.emits) if emits]
        tokens = self.sampler.sample(out.logits, emitting)
        return {seq.seq_id: [tok] for seq, tok in zip(emitting, tokens)}
