"""Quality metrics any arm can report: logits over a whole text, and perplexity, of the bare model
(`perplexity`) or through an arm's engine (`runner_perplexity`), where its plugins are in the path."""
from __future__ import annotations

import torch

from ablate.api.context import BuildContext, EngineConfig
from ablate.api.kv import KVSpec
from ablate.api.sequence import Request, Sequence
from ablate.api.slots import Attention
from ablate.api.step import Batch
from ablate.baselines.naive_attention import NaiveAttention, NaiveAttentionConfig
from ablate.baselines.no_cache import NoKVCache, NoKVCacheConfig
from ablate.engine.runner import ModelRunner
from ablate.engine.teacher import teacher_forced_logits
from ablate.model.forward import Forward
from ablate.model.llama import LlamaModel


@torch.inference_mode()
def sequence_logits(model: LlamaModel, token_ids: list[int], attention: Attention | None = None,
                    moe_experts: str = "loop") -> torch.Tensor:
    """Logits at every position of one sequence, (T, vocab) fp32: row i predicts token i + 1; a mixture
    of experts' experts computed the `moe_experts` way (engine.moe_experts)."""
    engine = EngineConfig(max_num_seqs=1)
    ctx = BuildContext(model, KVSpec.of(model, engine, len(token_ids)), engine)
    cache = NoKVCache(NoKVCacheConfig(), ctx)
    attention = attention or NaiveAttention(NaiveAttentionConfig(), ctx)
    runner = ModelRunner(model, cache, attention)
    seq = Sequence(Request(0, tuple(token_ids), max_new_tokens=1))
    step, _ = runner.inputs(Batch([seq], [len(token_ids)]))
    step = cache.begin_step(step)
    hidden = model(Forward(step, cache, attention, moe_experts=moe_experts))      # (T, d)
    return model.logits(hidden)                          # (T, V)


@torch.inference_mode()
def token_nlls(model: LlamaModel, token_ids: list[int], window: int = 512, stride: int = 256) -> torch.Tensor:
    """-log p(x_i | context) for i = 1 .. N-1, fp32 on the CPU, (N-1,): every token but the first, each once.

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
    # on the model's device, where the logits are: writing CUDA rows into a CPU buffer would sync every window
    nll = torch.empty(n - 1, dtype=torch.float32, device=next(model.parameters()).device)
    scored_to, begin = 1, 0              # token 0 has no context and is never predicted
    while True:
        end = min(begin + window, n)
        logits = sequence_logits(model, token_ids[begin:end]).float()   # (end-begin, V): row r predicts begin+r+1
        first = max(scored_to, begin + 1)                                # new tokens: first .. end-1
        rows = logits[first - begin - 1:end - begin - 1]                  # (end-first, V)
        targets = torch.tensor(token_ids[first:end], device=rows.device)[:, None]  # (end-first, 1)
        nll[first - 1:end - 1] = -torch.log_softmax(rows, dim=-1).gather(1, targets).squeeze(1)
        scored_to = end
        if end == n:
            return nll.cpu()
        begin += stride


def perplexity(model: LlamaModel, token_ids: list[int], window: int = 512, stride: int = 256) -> float:
    """exp( (1 / (N-1)) * sum_{i=1}^{N-1} -log p(x_i | x_{b(i)} .. x_{i-1}) ), b(i) the start of the
    window that scores token i (see `token_nlls`); the sum is accumulated in float64."""
    return float(torch.exp(token_nlls(model, token_ids, window, stride).double().mean()))


def runner_token_nlls(runner: ModelRunner, token_ids: list[int], num_prefill: int = 1) -> torch.Tensor:
    """-log p(x_i | x_0 .. x_{i-1}) for i = num_prefill .. N-1, fp32, (N - num_prefill,), as the
    runner's model, KV cache and attention compute them, by teacher forcing (ablate.engine.teacher):
    a cache that evicts, compresses or approximates acts on the scored text as on generated text
    (`token_nlls` scores the bare model instead)."""
    (logits,) = teacher_forced_logits(runner, [list(token_ids)], num_prefill)    # (N - num_prefill, V)
    targets = torch.tensor(token_ids[num_prefill:], device=logits.device)[:, None]
    return -torch.log_softmax(logits, dim=-1).gather(1, targets).squeeze(1).cpu()


def runner_perplexity(runner: ModelRunner, token_ids: list[int], num_prefill: int = 1) -> float:
    """exp( mean_{i >= num_prefill} -log p(x_i | x_<i) ) through the runner (`runner_token_nlls`),
    the mean accumulated in float64."""
    return float(torch.exp(runner_token_nlls(runner, token_ids, num_prefill).double().mean()))
