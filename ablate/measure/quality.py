"""Quality metrics any arm can report: logits over a whole text, and perplexity, of the bare model
(`perplexity`) or through an arm's engine (`runner_perplexity`), where its plugins are in the path."""
from __future__ import annotations

import torch

from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate.baselines.no_cache import NoKVCache, NoKVCacheConfig
from ablate.api.step import Batch
from ablate.api.context import BuildContext, EngineConfig, KVSpec
from ablate.api.slots import Attention
from ablate.model.llama import Forward, LlamaModel
from ablate.api.sequence import Request, Sequence
from ablate.engine.runner import ModelRunner


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


@torch.inference_mode()
def token_nlls(model: LlamaModel, token_ids: list[int], window: int = 512, stride: int = 256) -> torch.Tensor:
    """-log p(x_i | context) for i = 1 .. N-1, fp32, (N-1,): every token but the first, each once.

    Sliding window: windows [b, min(b + window, N)) for b = 0, stride, 2 stride, ... until one
    reaches the end; a window scores only the tokens no earlier window scored, so each scored
    token (after the first window) sees at least window - stride tokens of context. This is
    the windowing of Hugging Face's perplexity guide (labels -100 outside the new tokens).
    """
    n = len(token_ids)
    if n < 2:
        raise ValueError("perplexity needs at least two tokens")
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    if window > model.config.max_seq_len:
        raise ValueError(f"window {window} exceeds the model's max_seq_len {model.config.max_seq_len}")
    nll = torch.empty(n - 1, dtype=torch.float32)
    scored_to, begin = 1, 0              # token 0 has no context and is never predicted
    while True:
        end = min(begin + window, n)
        logits = sequence_logits(model, token_ids[begin:end]).float()   # (end-begin, V): row r predicts begin+r+1
        first = max(scored_to, begin + 1)                                # new tokens: first .. end-1
        rows = logits[first - begin - 1:end - begin - 1]                  # (end-first, V)
        targets = torch.tensor(token_ids[first:end]).unsqueeze(1)        # (end-first, 1)
        nll[first - 1:end - 1] = -torch.log_softmax(rows, dim=-1).gather(1, targets).squeeze(1)
        scored_to = end
        if end == n:
            return nll
        begin += stride


def perplexity(model: LlamaModel, token_ids: list[int], window: int = 512, stride: int = 256) -> float:
    """exp( (1 / (N-1)) * sum_{i=1}^{N-1} -log p(x_i | x_{b(i)} .. x_{i-1}) ), b(i) the start of the
    window that scores token i (see `token_nlls`); the sum is accumulated in float64."""
    return float(torch.exp(token_nlls(model, token_ids, window, stride).double().mean()))


@torch.inference_mode()
def runner_token_nlls(runner: ModelRunner, token_ids: list[int], num_prefill: int = 1) -> torch.Tensor:
    """-log p(x_i | x_0 .. x_{i-1}) for i = num_prefill .. N-1, fp32, (N - num_prefill,), as the
    runner's model, KV cache and attention compute them.

    Teacher forcing: the first `num_prefill` tokens go in as one prompt step, then every true
    token in a step of its own, as decoding feeds the tokens it emits; each step's logits score
    the token that comes next. So a cache that evicts, compresses or approximates acts on the
    scored text exactly as it would on generated text (`token_nlls` scores the bare model instead).
    """
    n = len(token_ids)
    if not 1 <= num_prefill < n:
        raise ValueError(f"need 1 <= num_prefill < len(token_ids), got num_prefill={num_prefill} for {n} tokens")
    cache = runner.kv_cache
    seq = Sequence(Request(0, tuple(token_ids[:num_prefill]), max_new_tokens=n - num_prefill))
    if not cache.can_admit(seq):
        raise RuntimeError(f"kv_cache={cache.name} cannot admit a sequence to score")
    cache.admit(seq)
    scored: list[torch.Tensor] = []
    try:
        for i in range(num_prefill, n):                           # this step's logits predict token i
            num_new = seq.num_tokens - seq.num_computed_tokens
            if not cache.grow(seq, num_new):
                raise RuntimeError(f"kv_cache={cache.name} has no room for token {i} of the scored text")
            logits, _ = runner.forward(Batch([seq], [num_new]))   # (1, V)
            scored.append(-torch.log_softmax(logits[-1].float(), dim=-1)[token_ids[i]])
            seq.token_ids.append(token_ids[i])                    # the true token, not a sampled one
    finally:
        cache.release(seq)
    return torch.stack(scored).cpu()


def runner_perplexity(runner: ModelRunner, token_ids: list[int], num_prefill: int = 1) -> float:
    """exp( mean_{i >= num_prefill} -log p(x_i | x_<i) ) through the runner (`runner_token_nlls`),
    the mean accumulated in float64."""
    return float(torch.exp(runner_token_nlls(runner, token_ids, num_prefill).double().mean()))
