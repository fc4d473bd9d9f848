"""llama.cpp's own batching across sequences, through llama-cpp-python's low-level API.

llama-cpp-python's high-level `Llama.generate` serves one sequence; llama.cpp itself decodes many at
once: one `llama_decode` call takes a batch of tokens, each tagged with its sequence and position, and
returns the logits of the tokens asked for. Here a batch of requests is served that way, as
llama.cpp's own `batched` example does: every prompt prefilled (several per call, up to n_batch
tokens), then one call per step with the last token of every sequence still running, each next token
the argmax of its row of logits (greedy: llama.cpp's samplers work on one sequence at a time). The
context holds n_seq_max sequences of up to `per_sequence` tokens each.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np


class BatchedContext:
    """A llama.cpp model and a context for `sequences` sequences of up to `per_sequence` tokens."""

    def __init__(self, path: Path, sequences: int, per_sequence: int, threads: int, n_batch: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.n_batch, self.sequences, self.per_sequence = n_batch, sequences, per_sequence
        self._stack = contextlib.ExitStack()
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self._stack.callback(lc.llama_model_free, self.model)
        params = lc.llama_context_default_params()
        params.n_ctx = sequences * per_sequence          # split evenly between the sequences
        params.n_seq_max = sequences
        params.n_batch = params.n_ubatch = max(n_batch, sequences)
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False                          # no shared prefix: each sequence its own cache
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            self.close()
            raise ValueError(f"llama.cpp could not make a context of {sequences} x {per_sequence} tokens")
        self._stack.callback(lc.llama_free, self.ctx)
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)
        self._stack.callback(lc.llama_batch_free, self.batch)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self._stack.close()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, sequence, position, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, seq, pos, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        status = self.lc.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {len(entries)} tokens")

    def _argmax(self, row: int) -> int:
        """The greedy token of the `row`-th token of the last batch that asked for logits."""
        logits = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def generate_greedy(self, prompts: Sequence[Sequence[int]], emit: Callable[[int, int], bool]) -> None:
        """Greedy continuations of `prompts` (one sequence each, at most `sequences`): emit(i, token) for
        each new token of prompt i, which returns True once prompt i wants no more."""
        if len(prompts) > self.sequences:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.sequences} sequences")
        if any(len(p) >= self.per_sequence for p in prompts):
            raise ValueError(f"a prompt fills the {self.per_sequence} tokens each sequence holds")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        # prefill: the prompts packed into calls of up to n_batch tokens; a prompt's last token asks for logits
        entries = [(t, seq, pos, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        last = {}                       # sequence -> (its next token, its position)
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            self._decode(chunk)
            for row, (_, seq, _, wants_logits) in enumerate(chunk):
                if wants_logits:
                    last[seq] = (self._argmax(row), len(prompts[seq]))
        running = [seq for seq in range(len(prompts)) if not emit(seq, last[seq][0])]
        while running:
            position_limit = [seq for seq in running if last[seq][1] >= self.per_sequence]
            if position_limit:
                raise RuntimeError(f"sequence {position_limit[0]} outgrew the {self.per_sequence} tokens it holds")
            self._decode([(last[seq][0], seq, last[seq][1], True) for seq in running])
            for row, seq in enumerate(running):
                last[seq] = (self._argmax(row), last[seq][1] + 1)
            running = [seq for seq in running if not emit(seq, last[seq][0])]
