"""engine=llamacpp: llama.cpp (through llama-cpp-python) on the experiment's GGUF checkpoint.

`weights`: shipped runs the file as it is (SmolLM2's is Q4_1: a quarter of fp32's bytes, and products in
llama.cpp's own quantised arithmetic: a different byte budget, labelled so); f32, f16 and bf16 run the same
weights rewritten (ablate.outside.gguf_rewrite), the bytes ablate's fp32 and a half-precision engine
stream. `batching`: `sequences` decodes a batch of greedy requests together, llama.cpp's own batching
across sequences (ablate/outside/llamacpp_batch.py), up to engine.max_num_seqs at once, each batch to
its end (static batching); `one` serves one request at a time through llama-cpp-python's generate(),
the only way for sampled requests (its samplers follow one sequence). Either way the cache is cleared
before each batch: no prefix reuse across requests or rounds, every prompt is prefilled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ablate.api.sequence import Request
from ablate.checkpoints.loader import checkpoint_path
from ablate.outside.batches import Emitter, OneBatchAtATime
from ablate.outside.contract import OutsideEngineConfig, option
from ablate.outside.gguf_rewrite import rewritten_gguf
from ablate.outside.llamacpp_batch import BatchedContext
from ablate.model.llama import LlamaModel

if TYPE_CHECKING:
    import llama_cpp


CONTEXT_ROUNDING = 256     # the context is the workload's longest sequence, rounded up to this
WEIGHTS = ("shipped", "f32", "f16", "bf16")
BATCHING = ("sequences", "one")


@dataclass
class LlamaCppConfig(OutsideEngineConfig):
    name: str = "llamacpp"
    weights: str = option("f32", "the GGUF it runs: shipped (as is), or rewritten in f32, f16 or bf16")
    threads: int = option(0, "CPU threads; 0: torch's, the same as ablate's arms")
    n_batch: int = option(512, "prompt tokens per llama.cpp decode call")
    batching: str = option("sequences", "sequences: greedy requests decoded together (llama.cpp's batch); "
                                        "one: a request at a time")

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {self.batching!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: torch's), got {self.threads}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.n_batch}")


class LlamaCpp(OneBatchAtATime):
    name = "llamacpp"
    requires = ("llama_cpp",)
    extra = "llamacpp"
    config_class = LlamaCppConfig
    config: LlamaCppConfig

    def __init__(self, config: LlamaCppConfig, model: LlamaModel, max_batch: int) -> None:
        super().__init__(config, model, max_batch)
        import torch

        cfg = model.config
        source = checkpoint_path(cfg) if (cfg.path or cfg.package) else None
        if source is None or source.suffix != ".gguf":
            raise ValueError(f"engine=llamacpp runs a GGUF checkpoint; model {cfg.name!r} has "
                             + (f"{source}" if source else "none (random weights)")
                             + ": use a GGUF model (model.path=<file.gguf> or a preset that ships one)")
        self.path = source if config.weights == "shipped" else rewritten_gguf(source, config.weights)
        self.threads = config.threads or torch.get_num_threads()
        self.llm: llama_cpp.Llama | None = None
        self.batched: BatchedContext | None = None
        self.n_ctx = 0

    def _context_tokens(self, batch: list[Request]) -> int:
        """Tokens of context each sequence needs: the batch's longest, rounded up. Sized to the workload, as
        ablate's own cache is (its max_seq_len): llama.cpp's decode step slows with the context allocated
        (8192 tokens of SmolLM2's context made a step ~3x slower than 512 here), so the context is not the
        model's maximum."""
        need = max(len(r.prompt_token_ids) + r.max_new_tokens for r in batch)
        return -(-need // CONTEXT_ROUNDING) * CONTEXT_ROUNDING

    def context_for(self, request: Request) -> llama_cpp.Llama:
        """llama-cpp-python's Llama with a context of at least the request's whole length."""
        import llama_cpp

        need = self._context_tokens([request])
        if self.llm is None or need > self.n_ctx:
            self.close()
            self.n_ctx = need
            self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_threads=self.threads,
                                       n_threads_batch=self.threads, n_batch=self.config.n_batch, verbose=False)
        return self.llm

    def batched_context_for(self, batch: list[Request]) -> BatchedContext:
        """A context for batch_limit() sequences, each of at least the batch's longest length."""
        need = self._context_tokens(batch)
        if self.batched is None or need > self.batched.per_sequence:
            self.close()
            self.batched = BatchedContext(self.path, self.batch_limit(), need, self.threads, self.config.n_batch)
            self.n_ctx = self.batch_limit() * need
        return self.batched

    @classmethod
    def is_exact(cls, config: LlamaCppConfig) -> bool:
        return False    # its own kernels and summation order (and, shipped, its quantised products)

    def describe(self) -> dict[str, str]:
        file_type = {"shipped": f"shipped ({self.path.name})", "f32": "F32 rewrite", "f16": "F16 rewrite",
                     "bf16": "BF16 rewrite"}
        batching = {"sequences": "static (llama.cpp's batch of sequences)", "one": "one request at a time"}
        return {"precision": {"shipped": "gguf-as-shipped", "f32": "fp32", "f16": "fp16", "bf16": "bf16"}[self.config.weights],
                "weights": file_type[self.config.weights], "batching": batching[self.config.batching],
                "threads": str(self.threads)}

    def batch_limit(self) -> int:
        return self.max_batch if self.config.batching == "sequences" else 1

    def weight_bytes(self) -> int:
        return self.path.stat().st_size

    def memory_bytes(self) -> int | None:
        """The file (mapped whole) and the K/V cache llama.cpp allocates for its context, f16 by default:
        n_ctx x layers x 2 (K, V) x H_kv x D x 2 bytes."""
        c = self.model.config
        return self.weight_bytes() + self.n_ctx * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2

    def generate(self, batch: list[Request], emit: Emitter) -> None:
        if self.config.batching == "sequences" and all(r.sampling.is_greedy for r in batch):
            ids = [r.request_id for r in batch]
            context = self.batched_context_for(batch)
            context.generate_greedy([r.prompt_token_ids for r in batch],
                                    lambda i, token: emit(ids[i], [token]) or emit.done(ids[i]))
            return
        for request in batch:             # sampled: llama.cpp's samplers, one sequence at a time
            self.generate_one(request, emit)

    def generate_one(self, request: Request, emit: Emitter) -> None:
        llm = self.context_for(request)
        sampling = request.sampling
        if sampling.is_greedy:
            knobs = {"temp": 0.0, "top_k": 1}
        else:
            llm.set_seed(sampling.seed or 0)
            knobs = {"temp": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        llm.reset()                       # forget the last request: reset=False below then keeps no prefix
        tokens = llm.generate(list(request.prompt_token_ids), reset=False, min_p=0.0, repeat_penalty=1.0,
                                   **knobs)
        for token in tokens:
            emit(request.request_id, [token])
            if emit.done(request.request_id):
                break

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        if self.batched is not None:
            self.batched.close()
            self.batched = None
