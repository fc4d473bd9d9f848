"""Does an arm that declares itself exact give the baseline's greedy tokens?

Token for token, up to ties. Two implementations of the same maths round differently (a fused
kernel, another matmul path, another batch shape), so where the model's two best next tokens are
within rounding of each other either may come out, and the continuation then differs legitimately.
A divergence counts against the arm only when the baseline's model, at the first position where
the outputs differ, prefers the baseline's token over the arm's by more than rounding can explain:

    logit(baseline token) - logit(arm token) > TIE_TOLERANCE[dtype] x max(1, max |logit|)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api.sequence import Sequence
from ablate.measure.quality import sequence_logits
from ablate.model.llama import LlamaModel

# relative rounding of the logits between two exact implementations, per model dtype
TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass
class Agreement:
    num_compared: int = 0      # greedy requests compared
    num_equal: int = 0         # identical outputs
    num_ties: int = 0          # first divergence at a near-tie: equal up to rounding
    num_diverged: int = 0      # first divergence beyond rounding
    first_divergence: str = ""  # the first such, described

    @property
    def matches(self) -> bool:
        return self.num_diverged == 0

    @property
    def rate(self) -> float:
        """Share of the compared requests whose outputs match up to rounding."""
        return (self.num_equal + self.num_ties) / self.num_compared if self.num_compared else float("nan")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(model: LlamaModel, baseline: list[Sequence], arm: list[Sequence]) -> Agreement:
    """Compare each greedy request's output with the baseline's (same requests, by id)."""
    tolerance = TIE_TOLERANCE.get(model.config.torch_dtype, 1e-2)
    by_id = {s.seq_id: s for s in arm}
    out = Agreement()
    for want in baseline:
        got = by_id.get(want.seq_id)
        if got is None or not want.request.sampling.is_greedy:
            continue
        out.num_compared += 1
        i = first_difference(want.output_token_ids, got.output_token_ids)
        if i is None:
            out.num_equal += 1
            continue
        if i >= min(want.num_output_tokens, got.num_output_tokens):   # one stopped earlier: a stop token differs
            margin, scale = float("inf"), 1.0
        else:
            context = list(want.request.prompt_token_ids) + want.output_token_ids[:i]
            logits = sequence_logits(model, context)[-1]                          # (V,)
            base, other = want.output_token_ids[i], got.output_token_ids[i]
            margin = float(logits[base] - logits[other])
            scale = max(1.0, float(logits.abs().max()))
        if margin <= tolerance * scale:
            out.num_ties += 1
            continue
        out.num_diverged += 1
        if not out.first_divergence:
            out.first_divergence = (f"request {want.seq_id} output token {i}: baseline "
                                    f"{want.output_token_ids[i:i + 1]}, arm {got.output_token_ids[i:i + 1]}, the "
                                    f"baseline's logit ahead by {margin:.3g} (rounding allows {tolerance * scale:.3g})")
    return out
