"""GGUF files of every family ablate reads, against transformers and llama.cpp on the same random weights.

    .venv/bin/python benchmarks/gguf_parity.py [--cases qwen3 gemma2 ...] [--out DIR]

Per case of ablate.testing.gguf_cases (a small random transformers model, written as an F32 GGUF the
way convert_hf_to_gguf.py writes it: ablate.testing.gguf_writer):
- llama.cpp: max |llama.cpp - transformers| over a 12-token prompt, over the spread of transformers'
  logits: that the file is llama.cpp's layout (llama-cpp-python 0.3.36, in a child process);
- ablate: the same for ablate reading the GGUF, and the share of 16 greedy tokens through its engine
  (contiguous cache) that equal transformers'.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()       # before torch loads, as the CLI does

import argparse
import importlib.util
import tempfile
from pathlib import Path

import pandas as pd
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request
from ablate.checkpoints import load_model
from ablate.engine.registry import default_registry
from ablate.measure.quality import sequence_logits
from ablate.testing.gguf_cases import CASES, case_model, llama_cpp_logits, spread_error
from ablate.testing.gguf_writer import write_gguf
from ablate.testing.hf_models import greedy, hf_logits, pretrained, random_prompt
from ablate.testing.scenarios import build

PROMPT, NEW_TOKENS = random_prompt(12), 16


def parity(case: str, folder: Path) -> dict:
    hf = case_model(case)
    path = write_gguf(hf, folder / f"{case}.gguf")
    expected = hf_logits(hf)(PROMPT)                                          # (T, V)
    row = {"case": case, "architecture": hf.config.model_type}
    if importlib.util.find_spec("llama_cpp") is not None:
        try:
            row["llama.cpp error / spread"] = spread_error(llama_cpp_logits(path, PROMPT, folder / "logits.npy"),
                                                           expected.numpy())
        except RuntimeError as err:
            row["llama.cpp error / spread"] = f"failed: {str(err).splitlines()[0]}"
    model = load_model(pretrained(path))
    with torch.no_grad():
        row["ablate error / spread"] = spread_error(sequence_logits(model, PROMPT).float().numpy(), expected.numpy())
    built = build(default_registry(), {"kv_cache": "contiguous"}, model, EngineConfig(max_num_seqs=1),
                  len(PROMPT) + NEW_TOKENS)
    try:
        (seq,) = built.engine.run([Request(0, tuple(PROMPT), NEW_TOKENS)])
    finally:
        built.close()
    want = greedy(hf_logits(hf), PROMPT, NEW_TOKENS)
    row["ablate greedy agreement"] = sum(a == b for a, b in zip(seq.output_token_ids, want)) / NEW_TOKENS
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = pd.DataFrame([parity(case, Path(tmp)) for case in args.cases])
    print(table.to_markdown(index=False, floatfmt=".2g"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "gguf_parity.csv", index=False)


if __name__ == "__main__":
    main()
