"""The quality guardrail: beside each arm's speed, how far its output is from the baseline's.

    token_agreement  mean over greedy requests of  common prefix(arm output, baseline output) /
                     baseline output length, against the baseline's outputs of the same round
                     (1: the same greedy text; sampled requests are not compared)
    ppl_ratio        perplexity of held-out text through the arm's runner / through the baseline's
                     (teacher forced, ablate.measure.quality.runner_perplexity: the arm's model
                     variant, KV cache and attention all act on the scored text; once per arm and
                     grid point, after the timed rounds)

Which weights are scored (`weights`): the timed ones, or the model's pretrained checkpoint converted
by each arm's variant, for experiments timed on random weights (ablate.experiment.quality_weights).

An arm lost quality when ppl_ratio > max_ppl_ratio or token_agreement < min_token_agreement: its
status becomes "degraded", and its time ratio is reported with that cost, never as a speedup. A
technique faster because its text degenerated (e.g. a conversion that makes the model repeat
itself, which an n-gram drafter then predicts trivially) is caught here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ablate.api.sequence import Sequence
from ablate.measure.exactness import first_difference

DEGRADED = "degraded"
WEIGHTS = ("timed", "pretrained")


@dataclass
class QualityConfig:
    enabled: bool = True              # false: no guardrail (quality columns empty, nothing flagged)
    heldout_tokens: int = 48          # tokens of held-out text scored through every arm's runner ...
    context_tokens: int = 16          # ... after this many as one prompt step (they are not scored)
    max_ppl_ratio: float = 1.05       # above: the arm lost quality (5% more perplexity than the baseline)
    min_token_agreement: float = 0.5  # below: the arm's greedy text left the baseline's early
    # timed: perplexity on the weights the arms are timed on; pretrained: on the model's pretrained
    # checkpoint, converted by each arm's variant (for arms timed on random weights)
    weights: str = "timed"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"experiment.quality.weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if not 1 <= self.context_tokens < self.heldout_tokens:
            raise ValueError(f"experiment.quality: need 1 <= context_tokens < heldout_tokens, got "
                             f"context_tokens={self.context_tokens}, heldout_tokens={self.heldout_tokens}")
        if not (math.isfinite(self.max_ppl_ratio) and self.max_ppl_ratio >= 1):
            raise ValueError(f"experiment.quality.max_ppl_ratio must be a number >= 1, got {self.max_ppl_ratio}")
        if not 0 <= self.min_token_agreement <= 1:
            raise ValueError(f"experiment.quality.min_token_agreement must be in [0, 1], got "
                             f"{self.min_token_agreement}")


def token_agreement(baseline: list[Sequence], arm: list[Sequence]) -> float:
    """Mean common-prefix share of the baseline's greedy outputs (NaN when none is greedy)."""
    by_id = {s.seq_id: s for s in arm}
    shares = []
    for want in baseline:
        got = by_id.get(want.seq_id)
        if got is None or not want.request.sampling.is_greedy or not want.output_token_ids:
            continue
        first = first_difference(want.output_token_ids, got.output_token_ids)
        shares.append((want.num_output_tokens if first is None else first) / want.num_output_tokens)
    return float(np.mean(shares)) if shares else math.nan


def verdict(cfg: QualityConfig, ppl_ratio: float, agreement: float) -> str:
    """'' when the arm kept quality, else what it lost, in words."""
    lost = []
    if math.isfinite(ppl_ratio) and ppl_ratio > cfg.max_ppl_ratio:
        lost.append(f"perplexity x{ppl_ratio:.2f} the baseline's (limit x{cfg.max_ppl_ratio:.2f})")
    if math.isfinite(agreement) and agreement < cfg.min_token_agreement:
        lost.append(f"greedy tokens agree {agreement:.0%} with the baseline's (limit {cfg.min_token_agreement:.0%})")
    return "lost quality: " + "; ".join(lost) if lost else ""
