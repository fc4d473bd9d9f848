"""The model toolkit for plugins that change or add models: variants (GQA, MLA conversions) and
drafters (a draft model, a subset of the target's layers).

    from ablate.api.model import LlamaModel, ModelConfig, SelfAttention, Linear, load_model

The decoder's structure (ablate/model/llama.py): model.embed, model.layers[i].attn (SelfAttention,
or MultiHeadLatentAttention), .attn_norm, .mlp_norm, .mlp, model.norm, model.lm_head, model.rope.
Every projection is an ablate Linear (weights (out, in), as nn.Linear). sequence_logits(model,
token_ids) runs the bare model over one text (calibration); calibration_text() is text a conversion
may calibrate on (the corpus's prompt part, never the held-out part perplexity is measured on).
"""
from ablate.checkpoints.loader import load_model, load_tokenizer
from ablate.measure.quality import sequence_logits
from ablate.model.config import ModelConfig
from ablate.model.presets import PRESETS, preset
from ablate.model.linear import Linear
from ablate.model.llama import LlamaModel, SelfAttention
from ablate.model.mla import MultiHeadLatentAttention, set_absorbed
from ablate.model.rope import RotaryEmbedding, apply_rope, llama3_scaled_inv_freq
from ablate.workload.text import calibration_text

__all__ = ["PRESETS", "Linear", "LlamaModel", "ModelConfig", "MultiHeadLatentAttention", "RotaryEmbedding",
           "SelfAttention", "apply_rope", "calibration_text", "llama3_scaled_inv_freq", "load_model",
           "load_tokenizer", "preset", "sequence_logits", "set_absorbed"]
