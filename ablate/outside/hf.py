"""engine=hf: Hugging Face transformers' `generate`, on the experiment's own weights.

A model read from a Hugging Face directory (model.path) is loaded from it by transformers, whatever
its architecture; any other (a GGUF file, a random preset) is rebuilt as transformers'
LlamaForCausalLM holding the same tensors. Either way the two engines differ only in how they run
the same weights: greedy tokens must then agree with ablate's (up to rounding, checked like an exact
plugin's). Its techniques are its own:
the KV cache it keeps (`cache`: dynamic grows per step, static is allocated once for the longest
sequence) and prompt-lookup decoding (`prompt_lookup`: n-gram drafts from the prompt, batch 1 only).

    experiment.arms.hf_static: {engine: {name: hf, cache: static}}
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ablate.api.sequence import Request
from ablate.outside.batches import Emitter, OneBatchAtATime
from ablate.outside.contract import OutsideEngineConfig, option
from ablate.model.llama import LlamaModel

PAD_ID = 0     # left padding of shorter prompts in a batch: masked out, never attended to
CACHES = ("dynamic", "static")


@dataclass
class HFConfig(OutsideEngineConfig):
    name: str = "hf"
    cache: str = option("dynamic", "the KV cache transformers keeps: dynamic (grows per step) or static "
                                   "(allocated once for the longest sequence)")
    prompt_lookup: int = option(0, "draft tokens per pass from prompt n-grams; 0: off (batch 1 when on)")

    def __post_init__(self) -> None:
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {self.cache!r}")
        if self.prompt_lookup < 0:
            raise ValueError(f"prompt_lookup must be >= 0, got {self.prompt_lookup}")


def hf_model(model: LlamaModel) -> Any:
    """transformers' model of the experiment's weights, in its dtype: loaded from the Hugging Face
    directory they came from (every architecture ablate reads), else rebuilt as a Llama (hf_llama)."""
    import transformers

    c = model.config
    if c.path and Path(c.path).is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(c.path, dtype=c.torch_dtype).eval()
        # the requests' own lengths and stop tokens end each row (UntilDone), not the checkpoint's eos
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = PAD_ID
        return hf
    return hf_llama(model)


def hf_llama(model: LlamaModel) -> Any:
    """transformers' LlamaForCausalLM holding `model`'s tensors (copied: the layouts differ), in its dtype."""
    import transformers
    try:
        from transformers.initialization import no_init_weights          # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights          # transformers 4

    c = model.config
    if c.attention_kind != "mha" or c.qkv_bias or c.qk_norm or c.architecture != "llama":
        raise ValueError(f"engine=hf rebuilds Llama models without QKV biases or q/k norms (any other "
                         f"architecture runs from its Hugging Face directory: model.path=DIR); model {c.name!r} is "
                         f"{c.architecture}/{c.attention_kind}" + (" with QKV biases" if c.qkv_bias else "")
                         + (" with q/k norms" if c.qk_norm else ""))
    scaling = {"rope_scaling": {"rope_type": "llama3", **c.rope_llama3_scaling}} if c.rope_llama3_scaling else {}
    config = transformers.LlamaConfig(
        hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.d_ff, vocab_size=c.vocab_size,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, **scaling, tie_word_embeddings=c.tied_embeddings,
        max_position_embeddings=c.max_seq_len, pad_token_id=PAD_ID, bos_token_id=None, eos_token_id=None)
    with no_init_weights():
        hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf.to(dtype=c.torch_dtype).eval()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """ablate's fused tensors split back into transformers' names (the inverse of from_hf_state_dict)."""
    c = model.config
    qs, kvs = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        q, k, v = layer.attn.wqkv.weight.split([qs, kvs, kvs])
        gate, up = layer.mlp.w_gate_up.weight.split([c.d_ff, c.d_ff])
        out |= {pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                pre + "self_attn.v_proj.weight": v, pre + "self_attn.o_proj.weight": layer.attn.wo.weight,
                pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
                pre + "mlp.down_proj.weight": layer.mlp.w_down.weight,
                pre + "input_layernorm.weight": layer.attn_norm.weight,
                pre + "post_attention_layernorm.weight": layer.mlp_norm.weight}
    out["lm_head.weight"] = model.embed.weight if c.tied_embeddings else model.lm_head.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


class StreamTo:
    """transformers' streamer interface: put() gets the prompt once, then each step's new tokens
    ((B,) a token each, or (1, n) from a prompt-lookup pass); they go to the emitter by row."""

    def __init__(self, request_ids: list[int], emit: Emitter) -> None:
        self.request_ids, self.emit, self.prompt_seen = request_ids, emit, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        rows = value.reshape(len(self.request_ids), -1).tolist()        # (B, new tokens)
        for request_id, tokens in zip(self.request_ids, rows):
            self.emit(request_id, tokens)

    def end(self) -> None:
        pass


class UntilDone:
    """transformers' stopping criterion, per row: a row stops once the emitter has its request done (its
    max_new_tokens, or a stop token of its own). Not transformers' eos_token_id: that stops every row of
    the batch at any request's stop token and pads it with PAD_ID, which would be kept as its tokens."""

    def __init__(self, request_ids: list[int], emit: Emitter) -> None:
        self.request_ids, self.emit = request_ids, emit

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([self.emit.done(i) for i in self.request_ids], dtype=torch.bool, device=input_ids.device)


class HFGenerate(OneBatchAtATime):
    name = "hf"
    requires = ("transformers",)
    extra = "hf"
    config_class = HFConfig
    config: HFConfig

    def __init__(self, config: HFConfig, model: LlamaModel, max_batch: int) -> None:
        super().__init__(config, model, max_batch)
        self.hf = hf_model(model)

    @classmethod
    def is_exact(cls, config: HFConfig) -> bool:
        return True     # the same tensors in the same dtype; prompt lookup keeps greedy tokens

    def describe(self) -> dict[str, str]:
        c = self.model.config
        weights = (f"the experiment's, from {c.path}" if c.path and Path(c.path).is_dir()
                   else "the experiment's, as transformers' Llama")
        return {"precision": c.dtype, "weights": weights,
                "batching": "static (one generate() per batch)" if self.batch_limit() > 1 else "one request at a time"}

    def batch_limit(self) -> int:
        return 1 if self.config.prompt_lookup else self.max_batch     # transformers' assisted decoding: batch 1

    def generate(self, batch: list[Request], emit: Emitter) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long, device=self.hf.device)   # (B, L) left-padded
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids, device=ids.device)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.max_new_tokens for r in batch)
        sampling = batch[0].sampling
        kwargs: dict[str, Any] = {"do_sample": False}
        if not sampling.is_greedy:
            torch.manual_seed(sampling.seed or 0)
            kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        if self.config.cache == "static":
            kwargs["cache_implementation"] = "static"
        if self.config.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.config.prompt_lookup
        from transformers import StoppingCriteriaList

        request_ids = [r.request_id for r in batch]
        with torch.inference_mode():
            self.hf.generate(ids, attention_mask=mask, max_new_tokens=longest, pad_token_id=PAD_ID,
                             stopping_criteria=StoppingCriteriaList([UntilDone(request_ids, emit)]),
                             streamer=StreamTo(request_ids, emit), **kwargs)
