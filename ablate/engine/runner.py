"""Execution: turn a Batch into packed tensors and run the model through the cache and attention slots.

The runner is what Decoding.step receives as its Executor. It changes no Sequence: it reads how
far each one is computed and feeds what comes next.
"""
from __future__ import annotations

import torch

from ablate.api.kv_cache import KVCache
from ablate.api.plugin import PluginError, blame
from ablate.api.slots import Attention
from ablate.api.step import Batch, StepInputs, StepLogits, device_tensor
from ablate.engine.graphs import DecodeGraphs, graph_mode, why_not_capturable
from ablate.model.forward import Forward
from ablate.model.product_paths import one_row_step
from ablate.model.llama import LlamaModel


class NonFiniteLogits(ValueError):
    """The model's first step gave NaN or infinite logits: every token after it would be garbage. A
    ValueError, so that a decoding plugin's `blame` passes it through: the model is at fault, not it."""


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, attention: Attention, decoding_name: str = "decoding",
                 graphs: bool = False, moe_experts: str = "loop") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = next(model.parameters()).device
        # engine.moe_experts (ablate/model/moe.py): how a mixture of experts computes its experts
        self.moe_experts = moe_experts
        self.has_experts = model.config.n_experts > 0
        dtype = next(model.parameters()).dtype
        if self.has_experts and moe_experts == "grouped" and self.device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"engine.moe_experts=grouped runs torch's grouped_mm, which takes bf16 on CUDA, and model "
                             f"{model.config.name!r} is {model.config.dtype}: set model.dtype=bf16, or "
                             "engine.moe_experts=loop")
        # engine.graphs (ablate/engine/graphs.py): decode steps replayed from CUDA graphs on a GPU,
        # their dense arithmetic compiled on a CPU
        self.graph_mode = graph_mode(self.device, graphs)
        refused = why_not_capturable(kv_cache, attention)
        if refused is None and self.has_experts and moe_experts == "loop":
            refused = "engine.moe_experts=loop reads each expert's token count on the host (grouped does not)"
        self.graphs = (DecodeGraphs(self.device, refused, compute_dtype=dtype)
                       if self.graph_mode == "cuda-graphs" else None)
        self.step_counts = {True: 0, False: 0}      # compile mode: steps run compiled, and not
        # decoder-layer passes run as two native calls (ablate/model/native/layers.py), and eagerly
        self.layer_passes = {"native": 0, "one_call": 0, "eager": 0}
        self.decoding_name = decoding_name          # who passes draft tokens, for error messages
        self.logits_checked = False                 # the first logits are checked once for NaN/inf

    def inputs(self, batch: Batch, draft_tokens: dict[int, list[int]] | None = None) -> tuple[StepInputs, list[int]]:
        """Pack the batch. Returns the step's inputs and, per sequence, how many logits rows it gets.

        A sequence feeds tokens[start : computed + n] + drafts, where start = computed with a cache
        that keeps K/V and 0 without one (recompute the prefix). It gets logits for its last
        1 + len(drafts) positions once its whole known prefix is in (batch.emits).
        """
        draft_tokens = draft_tokens or {}
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, query_starts, logits_rows, logits_indices = [], [], [0], [], []
        for seq, n, emits in zip(batch.seqs, batch.num_new_tokens, batch.emits):
            start = seq.num_computed_tokens if self.kv_cache.keeps_kv else 0
            drafts = draft_tokens.get(seq.seq_id, [])
            tokens = seq.token_ids[start:seq.num_computed_tokens + n] + drafts
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            query_starts.append(query_starts[-1] + len(tokens))
            rows = 1 + len(drafts) if emits else 0
            logits_rows.append(rows)
            logits_indices += range(query_starts[-1] - rows, query_starts[-1])
        # one host-to-device copy for the step's five index tensors, split into views on the device
        lists = (ids, positions, logits_indices, query_starts, context_lens)
        packed = device_tensor([v for values in lists for v in values], torch.long, self.device)
        input_ids, positions_t, logits_indices_t, query_starts_t, kv_lens_t = packed.split([len(v) for v in lists])
        step = StepInputs(
            seqs=batch.seqs,
            input_ids=input_ids,                                # (T,)
            positions=positions_t,                              # (T,)
            query_lens=query_lens,
            context_lens=context_lens,
            query_starts=query_starts,
            logits_indices=logits_indices_t,                    # (N,)
            query_starts_t=query_starts_t.to(torch.int32),      # (B+1,)
            kv_lens_t=kv_lens_t.to(torch.int32),                # (B,): the cache's prepare may replace it
        )
        return step, logits_rows

    def check_drafts(self, batch: Batch, draft_tokens: dict[int, list[int]]) -> None:
        if not draft_tokens:
            return
        index = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
        for seq_id, drafts in draft_tokens.items():
            i = index.get(seq_id)
            if i is None:
                raise PluginError(self.decoding_name, "step", f"draft tokens for sequence {seq_id}, which is not in the batch")
            if drafts and not batch.emits[i]:
                raise PluginError(self.decoding_name, "step", f"draft tokens for sequence {seq_id} in the middle of "
                                  "its prompt: drafts follow a sequence's last token (batch.emits)")
            if len(drafts) > batch.num_lookahead_tokens[i]:
                raise PluginError(self.decoding_name, "step", f"{len(drafts)} draft tokens for sequence {seq_id} but "
                                  f"the scheduler reserved room for {batch.num_lookahead_tokens[i]} "
                                  "(batch.num_lookahead_tokens)")

    def forward(self, batch: Batch, draft_tokens: dict[int, list[int]] | None = None) -> StepLogits:
        """Run one step (see ablate.api.Executor.forward). Returns logits (N, V) fp32 and the rows each
        sequence owns, in batch order."""
        draft_tokens = {k: v for k, v in (draft_tokens or {}).items() if v}
        self.check_drafts(batch, draft_tokens)
        step, rows = self.inputs(batch, draft_tokens)
        with blame(self.kv_cache, "prepare"):
            step = self.kv_cache.begin_step(step)
        if self.graphs is not None and not draft_tokens:
            logits = self.graphs.run(step, self._logits)                         # (N = B, V)
        else:
            logits = self._logits(step)                                          # (N, V)
        if not self.logits_checked and logits.numel():    # once: a single sync, in the first (prefill) step
            self.logits_checked = True
            self._check_finite(logits)
        return StepLogits(logits, rows)

    def _logits(self, step: StepInputs) -> torch.Tensor:
        """The eager forward pass: packed tokens -> logits (N, V) of the rows that need them."""
        compile_dense = self.graph_mode == "compile" and step.is_decode
        self.step_counts[compile_dense] += 1
        fwd = Forward(step, self.kv_cache, self.attention, compile=compile_dense, moe_experts=self.moe_experts)
        with one_row_step(step.num_tokens, self.model.lm_head.weight):
            hidden = self.model(fwd)                                                                # (T, d)
            logits = self.model.logits(hidden.index_select(0, step.logits_indices))                 # (N, V)
        self.layer_passes["native"] += fwd.native_layers
        self.layer_passes["one_call"] += fwd.one_call_layers
        self.layer_passes["eager"] += len(self.model.layers) - fwd.native_layers
        return logits

    def graph_stats(self) -> dict[str, str | int]:
        """How decode steps ran: engine.graphs' mode, the steps replayed (CUDA graphs) or run compiled (a
        CPU), the steps run eagerly, and the captures with their time."""
        if self.graphs is not None:
            return self.graphs.stats()
        mode, compiled = self.graph_mode, self.graph_mode == "compile"
        if compiled and not self.step_counts[True]:
            mode = "eager (no one-token decode step to compile)"
        # compile mode: "replays" are the steps that ran compiled
        return {"graphs": mode, "graph_captures": 0, "graph_replays": self.step_counts[True] if compiled else 0,
                "graph_eager_steps": self.step_counts[False] if compiled else 0, "graph_capture_s": 0.0}

    def layer_stats(self) -> dict[str, int]:
        """The decoder-layer passes that ran as native calls (native_layers; of those, one_call_layers with
        the cache's write and the attention inside a single call) and eagerly (eager_layers)."""
        return {"native_layers": self.layer_passes["native"], "one_call_layers": self.layer_passes["one_call"],
                "eager_layers": self.layer_passes["eager"]}

    def experts_stats(self) -> dict[str, str]:
        """How the experts ran: engine.moe_experts for a mixture of experts, "dense" for a model without."""
        return {"moe_experts": self.moe_experts if self.has_experts else "dense"}

    def _check_finite(self, logits: torch.Tensor) -> None:
        if bool(logits.isfinite().all()):
            return
        cfg = self.model.config
        source = f" from {cfg.path}" if cfg.path else ""
        raise NonFiniteLogits(
            f"model {cfg.name!r}{source} ({cfg.dtype}) gave non-finite logits (NaN or inf) in its first step: its "
            "weights hold NaN/inf, its dtype overflows (fp16: try model.dtype=bf16 or fp32), or the arm's "
            "attention or kv_cache plugin wrote garbage; every token generated would be meaningless")
