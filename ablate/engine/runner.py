"""Execution: turn a Batch into packed tensors, run the model through the cache and attention slots."""
from __future__ import annotations

import torch

from ablate.api.step import Batch, StepInputs
from ablate.api.slots import Attention, KVCache
from ablate.model.llama import Forward, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, attention: Attention) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = next(model.parameters()).device

    def inputs(self, batch: Batch, extra_tokens: dict[int, list[int]] | None = None) -> tuple[StepInputs, list[int]]:
        """Pack the batch. Returns the step's inputs and, per sequence, how many logits rows it gets.

        A sequence feeds tokens[start : computed + n] (+ `extra_tokens`, e.g. draft tokens to verify),
        where start = computed with a cache that keeps K/V and 0 without one (recompute the prefix).
        It gets logits for its last 1 + len(extra) positions once its whole known prefix is in.
        """
        extra_tokens = extra_tokens or {}
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, query_starts, logits_rows, logits_indices = [], [], [0], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens if self.kv_cache.keeps_kv else 0
            end = seq.num_computed_tokens + n
            extra = extra_tokens.get(seq.seq_id, [])
            tokens = seq.token_ids[start:end] + extra
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            query_starts.append(query_starts[-1] + len(tokens))
            rows = 1 + len(extra) if end == seq.num_tokens else 0
            logits_rows.append(rows)
            logits_indices += range(query_starts[-1] - rows, query_starts[-1])
        dev = self.device
        step = StepInputs(
            seqs=batch.seqs,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            query_starts=query_starts,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_starts_t=torch.tensor(query_starts, dtype=torch.int32, device=dev),
        )
        return step, logits_rows

    def forward(self, batch: Batch, extra_tokens: dict[int, list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns logits (N, V) fp32 and the rows each sequence owns, in batch order.

        Afterwards each sequence counts its fed tokens (and any extra ones) as computed; a caller
        that rejects extra tokens rolls both the sequence and the cache back.
        """
        step, rows = self.inputs(batch, extra_tokens)
        self.kv_cache.prepare(step)
        hidden = self.model(Forward(step, self.kv_cache, self.attention))        # (T, d)
        logits = self.model.logits(hidden.index_select(0, step.logits_indices))  # (N, V)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n + len((extra_tokens or {}).get(seq.seq_id, []))
        return logits, rows
