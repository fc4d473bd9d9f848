"""What speculative decoding reports: acceptance, tokens per target pass, costs, predicted speedup.

Per verification (one sequence in one target pass) with d drafts proposed and a accepted, the
positions 1..a are accepted, position a+1 (if a < d) is rejected, the rest are never tested.

  acceptance_rate = accepted / proposed                       (docs/speculative.md's definition)
  alpha           = accepted / tested, tested = accepted + rejections: the maximum-likelihood
                    probability that one draft token is accepted, if acceptances were independent
                    and equally likely at every position (the alpha of the speedup formula)
  acceptance at position j = accepted at j / tested at j      (constant in j if that model holds)
  tokens_per_target_forward = tokens emitted / verifications  (1 for autoregressive decoding)
  cost_ratio c    = (draft time per step / k) / target time per step, so k c + 1 is the measured
                    (draft + target) / target time of a speculative step
  predicted_speedup = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))   (Leviathan et al. 2023, eq. 1):
                    expected tokens per pass over the pass's cost in target passes; it assumes
                    independent acceptances, k drafts every step and a verify pass that costs what
                    an autoregressive step costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    if math.isnan(alpha) or math.isnan(cost_ratio):
        return math.nan
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + 1)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


@dataclass
class SpeculativeStats:
    k: int
    proposed: int = 0
    accepted: int = 0
    tested: int = 0
    emitted: int = 0
    verifications: int = 0
    steps: int = 0                  # steps with at least one sequence verifying drafts
    draft_s: float = 0.0
    target_s: float = 0.0
    tested_at: list[int] = field(default_factory=list)     # (k,) verifications that tested position j+1
    accepted_at: list[int] = field(default_factory=list)   # (k,) ... that accepted it
    # per sequence and step: (step, seq_id, proposed, accepted, emitted), for finer analysis than the means
    log: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tested_at = [0] * self.k
        self.accepted_at = [0] * self.k

    def record_verification(self, seq_id: int, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        self.log.append((self.steps, seq_id, num_proposed, num_accepted, num_emitted))
        self.verifications += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        self.emitted += num_emitted
        num_tested = min(num_proposed, num_accepted + 1)
        self.tested += num_tested
        for j in range(num_tested):
            self.tested_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def record_step(self, draft_s: float, target_s: float) -> None:
        self.steps += 1
        self.draft_s += draft_s
        self.target_s += target_s

    @property
    def alpha(self) -> float:
        return _ratio(self.accepted, self.tested)

    @property
    def cost_ratio(self) -> float:
        return _ratio(self.draft_s / self.k, self.target_s)

    def acceptance_by_position(self) -> list[float]:
        return [_ratio(a, t) for a, t in zip(self.accepted_at, self.tested_at)]

    def as_dict(self) -> dict[str, float | str]:
        return {
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": _ratio(self.accepted, self.proposed),
            "alpha": self.alpha,
            "acceptance_by_position": " ".join(f"{a:.3f}" for a in self.acceptance_by_position()),
            "proposed_per_verification": _ratio(self.proposed, self.verifications),
            "accepted_per_verification": _ratio(self.accepted, self.verifications),
            "tokens_per_target_forward": _ratio(self.emitted, self.verifications),
            "verifications": self.verifications,
            "draft_time_per_step_ms": _ratio(self.draft_s, self.steps) * 1e3,
            "target_time_per_step_ms": _ratio(self.target_s, self.steps) * 1e3,
            "cost_ratio": self.cost_ratio,
            "predicted_speedup": predicted_speedup(self.alpha, self.k, self.cost_ratio),
        }
