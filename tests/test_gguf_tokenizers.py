"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model = "llama": Llama 2, Mistral,
Phi-3, Gemma), tokenized as llama.cpp tokenizes them, and run as a text workload.

The vocabulary is trained here, offline, on Python's own documentation (pydoc_data): a BPE over
"▁"-spelled words, written the way llama.cpp's converter writes a SentencePiece model (<unk>, <s>,
</s>, the 256 <0xNN> byte tokens, control and user-defined tokens, then the pieces, each scored by
its merge order). llama.cpp (llama-cpp-python, in a child process: an abort kills only it) reads
the same file with vocab_only and is the reference.
"""
from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from ablate.checkpoints import load_model
from ablate.checkpoints.loader import load_tokenizer
from ablate.checkpoints.tokenizer import Tokenizer, sentencepiece_backend
from ablate.model.config import ModelConfig
from ablate.testing.gguf_writer import write_gguf
from ablate.testing.hf_models import build_hf, greedy, hf_logits
from ablate.workload.requests import WorkloadConfig, make_requests
from ablate.workload.text import load_corpus

pytest.importorskip("transformers")
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama.cpp not installed: pip install -e '.[llamacpp]'")

CONTROL_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
USER_DEFINED_TOKENS = ["<think>"]
SPACE_RUNS = ["\u2581" * n for n in (2, 3, 4, 8)]
NEW_TOKENS = 8


def pydoc_text() -> str:
    from pydoc_data.topics import topics
    return "\n".join(topics[k] for k in sorted(topics))


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style vocabulary trained on the first 200k
    characters of the pydoc text: each merged piece scored by its merge order, the single characters
    last, as in Llama 2's tokenizer.model -- but the pieces shuffled, so that only the scores give
    the merge order (as in Gemma's files)."""
    from tokenizers import SentencePieceBPETokenizer
    text = pydoc_text()[:200_000]
    trainer = SentencePieceBPETokenizer(add_prefix_space=True)
    trainer.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], vocab_size=800,
                                min_frequency=2, show_progress=False)
    learned = trainer.get_vocab()
    pieces = [p for p in sorted(learned, key=learned.get) if p != "<unk>"]
    # runs of spaces, which the trainer (it splits words at "▁") cannot learn but Llama 2 has
    pieces = SPACE_RUNS + [p for p in pieces if len(p) > 1] + [p for p in pieces if len(p) == 1]
    piece_scores = {p: -float(i) for i, p in enumerate(pieces)}
    random.Random(0).shuffle(pieces)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *CONTROL_TOKENS, *USER_DEFINED_TOKENS,
              *pieces]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS) + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
             + [gguf.TokenType.NORMAL] * len(pieces))
    first_piece = len(tokens) - len(pieces)
    scores = [0.0] * first_piece + [piece_scores[p] for p in pieces]
    return tokens, scores, [int(t) for t in types]


def sentencepiece_gguf(vocabulary, path: Path, *, add_space_prefix: bool = True, add_bos: bool = True,
                       kind: str = "llama", model: torch.nn.Module | None = None) -> Path:
    """`model` (by default a tiny random Llama) with `vocabulary`, as an F32 GGUF at `path`."""
    tokens, scores, types = vocabulary

    def write_vocabulary(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(kind)
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(add_bos)
        writer.add_add_space_prefix(add_space_prefix)

    model = model if model is not None else build_hf("llama-untied", vocab_size=len(tokens))
    return write_gguf(model, path, vocabulary=write_vocabulary)


def texts() -> list[str]:
    """Pieces of pydoc text the vocabulary was not trained on, cut anywhere (mid-word, at spaces,
    at newlines), and the edges: non-ASCII characters (byte fallback), leading and repeated spaces,
    newlines, empty text, special tokens inside text."""
    text = pydoc_text()[250_000:]
    rng = random.Random(0)
    cuts = [text[i:i + rng.randint(50, 900)] for i in (rng.randrange(len(text) - 1000) for _ in range(8))]
    return [text[:6000], *cuts,
            "naïve café — “quotes” ½ 東京 🙂 Ωmega", "é", "\u00a0non-breaking\u3000spaces",
            "", " ", "  ", " leading", "   indented code\n    more\n\tand a tab", "trailing  ", "\n", "\n\nx\n",
            "<s>hello<start_of_turn>user\n x<think>y</s>", "a<unk>b", "<think><think> <s>",
            "<end_of_turn><start_of_turn> model\n", "<start_of_turn", "x" * 300]


# llama.cpp's tokenize and detokenize of each text: run in a child process
LLAMA_CPP_TOKENIZE = """
import ctypes, json, sys
import llama_cpp
path, job, out = sys.argv[1:]
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm.model)

def detokenize(ids):
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    text = ctypes.create_string_buffer(64 * len(ids) + 16)
    n = llama_cpp.llama_detokenize(vocab, tokens, len(ids), text, len(text), False, True)
    return text.raw[:n].decode("utf-8")

results = []
for text in json.load(open(job)):
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    results.append({"ids": ids, "text": detokenize(ids),
                    "with_specials": llm.tokenize(text.encode(), add_bos=True, special=True)})
json.dump(results, open(out, "w"))
"""


def llama_cpp_tokenize(path: Path, pieces: list[str], tmp_path: Path) -> list[dict]:
    """Per text: llama.cpp's ids (special tokens parsed), its detokenized text, and its ids with the
    special tokens the file asks for (add_special: BOS when add_bos_token)."""
    job, out = tmp_path / "texts.json", tmp_path / "llama_cpp.json"
    job.write_text(json.dumps(pieces))
    run = subprocess.run([sys.executable, "-c", LLAMA_CPP_TOKENIZE, str(path), str(job), str(out)],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path.name} (exit {run.returncode}): {run.stderr[-2000:]}")
    return json.loads(out.read_text())


@needs_llama_cpp
@pytest.mark.parametrize("add_space_prefix", [True, False], ids=["space_prefix", "no_space_prefix"])
@pytest.mark.parametrize("add_bos", [True, False], ids=["bos", "no_bos"])
def test_llama_cpp_tokenizes_a_sentencepiece_gguf_as_ablate_does(vocabulary, add_space_prefix, add_bos, tmp_path):
    path = sentencepiece_gguf(vocabulary, tmp_path / "spm.gguf", add_space_prefix=add_space_prefix, add_bos=add_bos)
    tokenizer = Tokenizer.from_gguf(path)
    pieces = texts()
    specials = CONTROL_TOKENS + USER_DEFINED_TOKENS + ["<s>", "</s>", "<unk>"]
    tokens = vocabulary[0]
    for text, reference in zip(pieces, llama_cpp_tokenize(path, pieces, tmp_path)):
        ids = tokenizer.encode(text)
        assert ids == reference["ids"], (text[:80], [tokens[i] for i in ids][:40],
                                         [tokens[i] for i in reference["ids"]][:40])
        assert tokenizer.encode(text, add_special_tokens=True) == reference["with_specials"], text[:80]
        assert tokenizer.decode(ids) == text
        if not any(s in text for s in specials):       # llama.cpp keeps the space it put after a special token
            assert reference["text"] == text
    assert "<0xF0>" in [tokens[i] for i in tokenizer.encode("🙂")]       # byte fallback was exercised


@pytest.mark.parametrize("best", ["ab", "bc"])
def test_the_best_scored_pair_merges_first_whatever_the_token_order(best):
    """llama.cpp's SentencePiece merges by score: "▁abc" is ▁a + bc when bc scores best, ▁ + ab + c
    (no ▁ab in the vocabulary) when ab does -- token order in the file is the same both times."""
    tokens = ["<unk>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a"]
    scores = {"ab": {"ab": -1.0, "bc": -3.0, "\u2581a": -2.0}, "bc": {"ab": -3.0, "bc": -1.0, "\u2581a": -2.0}}[best]
    backend = sentencepiece_backend(tokens, [scores.get(t, -10.0) for t in tokens], [2] + [1] * 7, unk_token="<unk>",
                                    add_space_prefix=True)
    expected = ["\u2581a", "bc"] if best == "bc" else ["\u2581", "ab", "c"]
    assert backend.encode("abc").tokens == expected


@pytest.mark.parametrize("kind", ["t5", "rwkv", "bert"])
def test_a_vocabulary_ablate_cannot_tokenize_is_named_with_the_kinds_it_can(vocabulary, kind, tmp_path):
    path = sentencepiece_gguf(vocabulary, tmp_path / f"{kind}.gguf", kind=kind)
    with pytest.raises(ValueError, match=rf"^{path}: tokenizer.ggml.model is '{kind}', .*'gpt2' .*and 'llama'"):
        load_tokenizer(ModelConfig(name="checkpoint", init="pretrained", path=str(path)))


def test_a_sentencepiece_gguf_runs_a_text_workload_as_transformers_decodes_it(vocabulary, build, tmp_path):
    """Llama 2's shape of file: text prompts (BOS first) cut from the corpus, greedy text identical to
    transformers' on the same weights."""
    tokens = vocabulary[0]
    hf = build_hf("llama-untied", vocab_size=len(tokens))
    path = sentencepiece_gguf(vocabulary, tmp_path / "llama2-like.gguf", model=hf)
    cfg = ModelConfig(name="checkpoint", init="pretrained", path=str(path))
    model, tokenizer = load_model(cfg), load_tokenizer(cfg)
    workload = WorkloadConfig(source="text", num_requests=3, prompt_len=24, output_len=NEW_TOKENS)
    requests = make_requests(workload, model.config.vocab_size, tokenizer, model.config.max_seq_len)
    corpus = "\n".join(d["text"] for d in load_corpus())
    for request in requests:
        assert len(request.prompt_token_ids) == 24 and request.prompt_token_ids[0] == tokenizer.bos_id == 1
        assert tokenizer.decode(request.prompt_token_ids[1:-1]) in corpus    # the last token may be a byte of a character
    sequences = build({"kv_cache": "contiguous"}, model, record=False).engine.run(requests)
    for request, seq in zip(requests, sequences):
        assert seq.output_token_ids == greedy(hf_logits(hf), list(request.prompt_token_ids), NEW_TOKENS)


@pytest.mark.slow      # the whole job, from the composed config to the results folder (~9 s)
def test_a_job_of_text_prompts_runs_on_a_sentencepiece_gguf(vocabulary, compose_config, registry, tmp_path):
    import pandas as pd

    from ablate.experiment.job import run_job
    path = sentencepiece_gguf(vocabulary, tmp_path / "llama2-like.gguf")
    raw = compose_config(tmp_path, f"model.path={path}", "workload.source=text", "workload.num_requests=2",
                         "workload.prompt_len=16", "workload.output_len=4", "experiment.repeats=1",
                         "experiment.warmup=0", "wandb.mode=disabled")
    folder = run_job(raw, registry)
    runs = pd.read_csv(folder.path / "runs.csv")
    assert list(runs["status"]) == ["ok"] and runs["prompt_tokens"].item() == 2 * 16
    assert runs["perplexity"].item() > 1      # the held-out text went through the tokenizer too
