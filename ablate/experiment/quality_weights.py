"""Which weights the quality guardrail scores (experiment.quality.weights).

    timed       the arm's timed model: perplexity through the very runner that was timed
    pretrained  the model's pretrained checkpoint (model.path or model.package), built into each arm
                as its timed model is (the arm's variant converts it: GQA pooling, MLA's SVD with its
                calibration), while the rounds are timed on whatever model.init says

An experiment timed on random weights (speed does not depend on their values) gets, with
`pretrained`, the quality each arm's conversion costs a real model: perplexity of held-out text
(encoded by the checkpoint's tokenizer) through the converted checkpoint / through the baseline
arm's. The timed model's greedy text then comes from other weights than the scored ones, so the
verdict rests on the perplexity ratio alone. A checkpoint that cannot be loaded (not installed) is
said in one line and leaves the perplexity columns empty; the experiment goes on.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ablate.api.context import EngineConfig
from ablate.engine.arm import Arm
from ablate.engine.registry import Registry
from ablate.experiment.arm_run import arm_perplexity
from ablate.experiment.quality_guard import QualityConfig, verdict
from ablate.model.llama import LlamaModel


class ScoredWeights:
    """The model each arm's perplexity is measured on, loaded once per set of model overrides."""

    def __init__(self, cfg: QualityConfig, model_for: Callable[[Arm], LlamaModel],
                 model_loader: Callable[[dict[str, Any]], LlamaModel]) -> None:
        self.cfg = cfg
        self.model_for = model_for            # the timed model of an arm (before its variant)
        self.model_loader = model_loader      # model fields over the experiment's model -> a model
        self.pretrained: dict[str, LlamaModel] = {}
        self.unavailable = ""                 # why no pretrained checkpoint could be loaded
        self.scores_timed = True              # the last perplexities() scored the timed weights

    def is_timed(self, arm: Arm) -> bool:
        """The scored weights are the timed ones: weights=timed, or the timed model is pretrained already."""
        return self.cfg.weights == "timed" or self.model_for(arm).config.init == "pretrained"

    def model(self, arm: Arm) -> LlamaModel | None:
        """The model `arm` is scored on, before its variant (build_arm applies it); None when the
        pretrained checkpoint cannot be loaded (`unavailable` says why)."""
        if self.is_timed(arm):
            return self.model_for(arm)
        key = repr(sorted(arm.model_overrides.items()))
        if key not in self.pretrained and not self.unavailable:
            try:
                self.pretrained[key] = self.model_loader({**arm.model_overrides, "init": "pretrained"})
            except (OSError, ValueError) as err:     # not installed, or no checkpoint for this model
                self.unavailable = (f"no pretrained checkpoint of model {self.model_for(arm).config.name!r} to "
                                    f"score (experiment.quality.weights=pretrained): {err}")
        return self.pretrained.get(key)

    def describe(self, arm: Arm) -> str:
        """Which weights an arm's perplexity comes from, in words."""
        model = self.model(arm)
        if model is None:
            return self.unavailable
        cfg = model.config
        where = cfg.path or cfg.package or "no checkpoint"
        if self.is_timed(arm):
            return f"the timed weights ({cfg.init}, {where})"
        return f"the pretrained checkpoint {where}, converted by each arm's variant (timed on {self.model_for(arm).config.init} weights)"

    def heldout(self, model: LlamaModel, tokenizer, num_tokens: int, seed: int) -> list[int]:
        """Held-out text, never used for prompts: with `tokenizer` (the workload's), else the
        checkpoint's when a pretrained one is scored; seeded random ids for random weights."""
        if tokenizer is None and model.config.init == "pretrained" and self.cfg.weights == "pretrained":
            from ablate.checkpoints.loader import load_tokenizer
            tokenizer = load_tokenizer(model.config)
        if tokenizer is not None:
            from ablate.workload.text import heldout_tokens
            return heldout_tokens(tokenizer, num_tokens)
        generator = torch.Generator().manual_seed(10_000 + seed)
        return torch.randint(model.config.vocab_size, (num_tokens,), generator=generator, device="cpu").tolist()

    def perplexities(self, arms: list[Arm], tokenizer_for, seed: int, engine_cfg: EngineConfig,
                     registry: Registry) -> dict[str, float]:
        """arm -> perplexity of the held-out text after the first context_tokens, through the arm's
        runner on its scored model; arms[0] (the baseline) first. {} when the baseline has no model."""
        self.scores_timed = self.is_timed(arms[0])
        base = self.model(arms[0])
        if base is None:
            return {}
        tokens = self.heldout(base, tokenizer_for(base), self.cfg.heldout_tokens, seed)
        out = {}
        for arm in arms:
            model = self.model(arm)
            if model is not None:
                out[arm.name] = arm_perplexity(arm, model, tokens, self.cfg.context_tokens, engine_cfg, registry)
        return out

    def verdict(self, ppl_ratio: float, agreement: float) -> str:
        """quality_guard.verdict; the timed greedy text's agreement counts only when it comes from the
        scored weights (the baseline's, as `perplexities` found them)."""
        return verdict(self.cfg, ppl_ratio, agreement if self.scores_timed else math.nan)
