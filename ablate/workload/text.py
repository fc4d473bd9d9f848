"""Real English text for prompts and perplexity: the shipped Python-documentation corpus.

`ablate/data/python_docs.jsonl` (see `ablate/data/make_corpus.py` for its origin and licence) is
split by topic, deterministically, into a prompt part and a held-out part that no prompt is cut
from, so that perplexity is measured on text the prompts never showed.
"""
from __future__ import annotations

import random
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ablate.checkpoints.tokenizer import Tokenizer

CORPUS_PATH = Path(__file__).parents[1] / "data" / "python_docs.jsonl"
HELDOUT_EVERY = 5            # topics 4, 9, 14... (alphabetical) are held out: 15 of 79, ~20 %

# instructions of "quote" prompts: each makes a good answer copy (most of) the passage it is given
QUOTE_INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word, and say nothing else.",
    "Copy the passage below verbatim, keeping every line break.",
    "Fix any typos in the following passage and write it out again in full; if there are none, "
    "repeat it unchanged.",
    "Rewrite the following passage exactly as it is, but in British spelling.",
)


@cache
def _corpus() -> tuple[tuple[str, str], ...]:
    import json

    with open(CORPUS_PATH, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((row["topic"], row["text"]) for row in rows)


def load_corpus() -> list[dict[str, str]]:
    """Every topic, alphabetical: [{"topic": ..., "text": ...}, ...]."""
    return [{"topic": topic, "text": text} for topic, text in _corpus()]


def split_corpus(heldout_every: int = HELDOUT_EVERY) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(prompt topics, held-out topics): every `heldout_every`-th topic in alphabetical order is held out."""
    docs = load_corpus()
    prompt = [d for i, d in enumerate(docs) if i % heldout_every != heldout_every - 1]
    heldout = [d for i, d in enumerate(docs) if i % heldout_every == heldout_every - 1]
    return prompt, heldout


def calibration_text() -> str:
    """The corpus's prompt part as one text: what conversions may calibrate on (never the held-out part)."""
    return "\n\n".join(d["text"] for d in split_corpus()[0])


def heldout_text() -> str:
    """The held-out topics joined by blank lines (the perplexity text)."""
    return "\n\n".join(d["text"] for d in split_corpus()[1])


def heldout_tokens(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the held-out text (BOS first if the tokenizer adds one)."""
    ids = tokenizer.encode(heldout_text(), add_special_tokens=True)
    if len(ids) < num_tokens:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def _paragraph_starts(text: str) -> list[int]:
    """Character offsets where a paragraph begins (start of text, or after a blank line)."""
    return [0] + [m.end() for m in re.finditer(r"\n\n+(?=\S)", text)]


def _passage_tokens(tokenizer: Tokenizer, text: str, starts: list[int], rng: random.Random,
                    num_tokens: int) -> list[int]:
    """`num_tokens` tokens of text from a random paragraph start (a prefix of its tokenization)."""
    # ~4 characters per token in English prose; take twice that so the cut is never short
    chars = 8 * num_tokens + 64
    for _ in range(100):
        start = rng.choice(starts)
        ids = tokenizer.encode(text[start:start + chars])
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"the prompt text cannot give passages of {num_tokens} tokens")


def text_prompts(tokenizer: Tokenizer, num: int, prompt_len: int, seed: int = 0,
                 kind: str = "open") -> list[list[int]]:
    """`num` token-id prompts of about `prompt_len` tokens each, cut from the prompt part of the corpus.

    kind="open":  a passage starting at a paragraph, to be continued (exactly prompt_len tokens,
                  BOS first if the tokenizer adds one).
    kind="quote": a chat turn asking the model to repeat or lightly edit a passage given in the
                  prompt, so that a good answer quotes its input (prompt-lookup / n-gram drafting
                  for speculative decoding has something to find). The passage is sized so that the
                  whole rendered prompt is prompt_len tokens, give or take a token or two where BPE
                  merges across the join.
    Deterministic in (tokenizer, num, prompt_len, seed, kind).
    """
    if kind not in ("open", "quote"):
        raise ValueError(f"kind must be 'open' or 'quote', got {kind!r}")
    if prompt_len < 1 or num < 0:
        raise ValueError(f"need num >= 0 and prompt_len >= 1, got num={num}, prompt_len={prompt_len}")
    text = "\n\n".join(d["text"] for d in split_corpus()[0])
    starts = _paragraph_starts(text)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        if kind == "open":
            bos = [tokenizer.bos_id] if _adds_bos(tokenizer) else []
            prompts.append(bos + _passage_tokens(tokenizer, text, starts, rng, prompt_len - len(bos)))
            continue
        instruction = rng.choice(QUOTE_INSTRUCTIONS)
        overhead = len(tokenizer.encode(_quote_text(tokenizer, instruction, "")))
        if prompt_len - overhead < 8:
            raise ValueError(f"prompt_len={prompt_len} is too short for a quote prompt: the instruction "
                             f"and chat markup alone take {overhead} tokens")
        passage_ids = _passage_tokens(tokenizer, text, starts, rng, prompt_len - overhead)
        passage = tokenizer.decode(passage_ids).strip()
        prompts.append(tokenizer.encode(_quote_text(tokenizer, instruction, passage)))
    return prompts


def _adds_bos(tokenizer: Tokenizer) -> bool:
    ids = tokenizer.encode("a", add_special_tokens=True)
    return tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id]


def _quote_text(tokenizer: Tokenizer, instruction: str, passage: str) -> str:
    content = f"{instruction}\n\n{passage}"
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return f"{content}\n\nAnswer:\n"
