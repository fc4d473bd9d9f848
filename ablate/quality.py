"""Quality metrics any arm can report: logits over a whole text, and perplexity."""
from __future__ import annotations

import torch

from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate.baselines.no_cache import NoKVCache, NoKVCacheConfig
from ablate.batch import Batch
from ablate.build import BuildContext, EngineConfig, KVSpec
from ablate.interfaces import Attention
from ablate.model.llama import Forward, LlamaModel
from ablate.request import Request, Sequence
from ablate.runner import ModelRunner


@torch.inference_mode()
def sequence_logits(model: LlamaModel, token_ids: list[int], attention: Attention | None = None) -> torch.Tensor:
    """Logits at every position of one sequence, (T, vocab) fp32: row i predicts token i + 1."""
    engine = EngineConfig(max_num_seqs=1)
    ctx = BuildContext(model, KVSpec.of(model, engine, len(token_ids)), engine)
    cache = NoKVCache(NoKVCacheConfig(), ctx)
    attention = attention or NaiveAttention(NaiveAttentionConfig(), ctx)
    runner = ModelRunner(model, cache, attention)
    seq = Sequence(Request(0, tuple(token_ids), max_new_tokens=1))
    step, _ = runner.inputs(Batch([seq], [len(token_ids)]))
    cache.prepare(step)
    hidden = model(Forward(step, cache, attention))      # (T, d)
    return model.logits(hidden)                          # (T, V)
