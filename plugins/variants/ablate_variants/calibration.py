"""Calibration for activation-aware conversions: the second moment of each attention layer's input.

A truncated SVD of a weight matrix M keeps what matters for inputs spread evenly over every
direction; a transformer's inputs are not (a few channels carry most of the norm). With
C = E[x x^T] over real inputs and C = L L^T (Cholesky), the rank-r A minimising E||(M - A) x||^2
is A = (M L)_r L^-1 (the SVD of M L truncated, then mapped back; SVD-LLM, Wang et al. 2024).
This file measures C per layer over calibration text: the prompt part of the shipped corpus
(ablate.api.model.calibration_text), never its held-out part, which perplexity is measured on.
"""
from __future__ import annotations

import torch

from ablate.api.model import LlamaModel, calibration_text, load_tokenizer, sequence_logits


def calibration_token_ids(model: LlamaModel, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` tokens of the corpus's prompt part with the model's tokenizer (a pretrained model),
    or seeded random token ids (a randomly initialised one, which has no tokenizer of its own)."""
    cfg = model.config
    if cfg.init == "pretrained" and (cfg.path or cfg.package):
        ids = load_tokenizer(cfg).encode(calibration_text(), add_special_tokens=True)
        if len(ids) < num_tokens:
            raise ValueError(f"the corpus's prompt part has {len(ids)} tokens, fewer than the {num_tokens} asked for")
        return ids[:num_tokens]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen, device="cpu").tolist()


@torch.inference_mode()
def attention_input_moments(model: LlamaModel, token_ids: list[int], window: int = 512) -> list[torch.Tensor]:
    """Per layer, sum over tokens of x x^T for the input x (d_model,) of its attention (after the
    norm): (d_model, d_model) float64 on the CPU. The text runs in windows of `window` tokens."""
    d = model.config.d_model
    moments = [torch.zeros(d, d, dtype=torch.float64, device="cpu") for _ in model.layers]   # as the docstring says

    def accumulate(index: int):
        def hook(module, args) -> None:
            x = args[0].detach().to("cpu", torch.float64)                 # (T, d)
            moments[index].add_(x.T @ x)
        return hook

    handles = [layer.attn.register_forward_pre_hook(accumulate(i)) for i, layer in enumerate(model.layers)]
    try:
        window = min(window, model.config.max_seq_len)
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start:start + window]
            if len(chunk) > 1:
                sequence_logits(model, chunk)
    finally:
        for handle in handles:
            handle.remove()
    return moments
