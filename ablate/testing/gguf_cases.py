"""The GGUF families tested and measured (tests/test_gguf_families.py, benchmarks/gguf_parity.py): a
random transformers model per case, changed to what a GGUF can say, and llama.cpp's logits for a file.

Each case's overrides are what a GGUF can say: llama.cpp fixes Gemma's query scale at
1/sqrt(head_dim) and Gemma 3's full layers at one in six, makes every Qwen2-MoE layer sparse, needs
an expert count on DeepSeek's dense models, and knows V2-Lite (no q_lora_rank) by its 27 layers.
The DeepSeek-V2 MoE case routes without expert groups: with V2's groups (group_limited_greedy)
llama.cpp 0.3.36's logits differ from transformers' by 2.5% of their spread (ablate follows transformers).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ablate.testing.hf_models import DEEPSEEK_YARN, build_hf

# case -> (random model kind, its config fields changed to what the GGUF can say)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama-untied", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)),
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2-moe", dict(mlp_only_layers=[])),
    "qwen3-moe": ("qwen3-moe", {}),
    "deepseek-v2": ("deepseek-v2", dict(num_experts_per_tok=2)),
    "deepseek-v2-lite": ("deepseek-v2-lite", dict(num_experts_per_tok=2, num_hidden_layers=27)),
    "deepseek-v2-moe": ("deepseek-v2-moe", dict(topk_method="greedy", n_group=None, topk_group=None)),
    "deepseek-v3-moe": ("deepseek-v3-moe", {}),
    "deepseek-v3-yarn": ("deepseek-v3-yarn", dict(rope_scaling=dict(DEEPSEEK_YARN, mscale=0.8))),
}


def case_model(case: str) -> torch.nn.Module:
    kind, fields = CASES[case]
    return build_hf(kind, **fields)


def spread_error(got: np.ndarray, expected: np.ndarray) -> float:
    """max |got - expected| over the spread (max - min) of the expected logits."""
    return float(np.abs(got - expected).max() / (expected.max() - expected.min()))


# llama.cpp's logits for a token list: run in a child process (an abort in ggml kills only it)
LLAMA_CPP = """
import sys, numpy as np
from llama_cpp import Llama
tokens = [int(t) for t in sys.argv[3].split(",")]
llm = Llama(model_path=sys.argv[1], logits_all=True, n_ctx=64, n_threads=1, verbose=False)
llm.eval(tokens)
np.save(sys.argv[2], np.array(llm.scores[:len(tokens)], dtype=np.float32))
"""


def llama_cpp_logits(path: Path, tokens: list[int], out: Path) -> np.ndarray:
    """(T, V) llama.cpp's logits for `tokens` from the GGUF at `path` (saved at `out` on the way); a
    RuntimeError with llama.cpp's last words when it fails."""
    run = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(path), str(out), ",".join(map(str, tokens))],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path.name} (exit {run.returncode}): {run.stderr[-2000:]}")
    return np.load(out)
