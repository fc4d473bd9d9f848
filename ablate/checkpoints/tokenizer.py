"""A tokenizer: the `tokenizers` package's BPE behind a small interface, plus the chat template.

Built either from a checkpoint directory's `tokenizer.json` (+ `tokenizer_config.json`), or from
a GGUF's metadata. A GGUF carries no tokenizer.json, only llama.cpp's description of it
(tokenizer.ggml.*); `from_gguf_metadata` rebuilds it for the two kinds of vocabulary we meet:

    gpt2    byte-level BPE (Llama 3, Qwen, SmolLM2), as transformers builds it when it loads the GGUF
            (transformers.integrations.gguf): the file's vocabulary and merges, control tokens as
            special added tokens, user-defined ones as plain added tokens, and the pre-tokenizer
            split picked by `tokenizer.ggml.pre` -- for a value transformers does not list
            (SmolLM2's "smollm" among them) the GPT-2 regex of `ByteLevel(use_regex=True)`.
    llama   SentencePiece (Llama 2, Mistral, Phi-3, Gemma 2/3), as llama.cpp tokenizes it; see
            `sentencepiece_backend`.
"""
from __future__ import annotations

import itertools
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SUPPORTED_KINDS = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
SPACE = "\u2581"     # SentencePiece's visible space, "▁"

# pre-tokenizer splits by tokenizer.ggml.pre, as transformers' GGUF_PRE_TOKENIZER_SPLITS (the ones
# for the Llama-architecture vocabularies we meet); anything else gets ByteLevel's GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves, the
    other 68 to U+0100 onwards, so that every byte string is a string of visible characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 pad_token: str | None = None, chat_template: str | None = None, source: str = "",
                 runs_start_with_space: bool = False) -> None:
        """runs_start_with_space: encoding puts a space before each run of text between added
        tokens (llama.cpp's SentencePiece), so decoding drops one again from each run."""
        self.backend = backend
        self.runs_start_with_space = runs_start_with_space
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template
        self.source = source

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        from ablate.checkpoints.gguf import read_gguf
        return cls.from_gguf_metadata(read_gguf(path).metadata, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "gguf") -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"{source}: tokenizer.ggml.model is {kind!r}, a vocabulary ablate cannot tokenize; "
                             f"the supported kinds are {SUPPORTED_KINDS}")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        if kind == "llama":
            add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)     # llama.cpp's defaults
            backend = sentencepiece_backend(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                            unk_token=token("unknown_token_id"), add_space_prefix=add_space_prefix)
            add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
        else:
            backend, add_space_prefix = byte_level_backend(tokens, types, meta), False
            add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
        bos, eos = token("bos_token_id"), token("eos_token_id")
        _set_post_processor(backend, bos if add_bos else None,
                            eos if meta.get("tokenizer.ggml.add_eos_token", False) else None)
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=token("padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"), source=source,
                   runs_start_with_space=add_space_prefix)

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """tokenizer.json, with special tokens and the chat template from tokenizer_config.json
        (or chat_template.jinja, where transformers 5 writes it)."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json")
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):       # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        model_config = _read_json(directory / "config.json")

        def token(name: str) -> str | None:
            t = config.get(name)
            if isinstance(t, dict):
                t = t.get("content")
            if t is None and model_config.get(f"{name}_id") is not None:
                t = backend.id_to_token(model_config[f"{name}_id"])
            return t

        return cls(backend, bos_token=token("bos_token"), eos_token=token("eos_token"),
                   pad_token=token("pad_token"), chat_template=template, source=str(directory))

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int]) -> str:
        """Special tokens are kept, so that decode(encode(text)) == text for any text."""
        if not self.runs_start_with_space:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        # each run between added tokens was encoded with a space put before it: decoded alone, each
        # run loses it again (the decoder strips one leading space)
        runs = itertools.groupby(ids, key=lambda i: i in self._added_ids)
        return "".join(self.backend.decode(list(run), skip_special_tokens=False) for _, run in runs)

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self.backend.get_added_tokens_decoder())

    @property
    def bos_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def pad_id(self) -> int | None:
        return self.backend.token_to_id(self.pad_token) if self.pad_token else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The conversation as text, rendered the way transformers renders chat templates (jinja2
        sandbox, trim_blocks and lstrip_blocks, `raise_exception`, `tojson`)."""
        if not self.chat_template:
            raise ValueError(f"{self.source}: this tokenizer has no chat template")
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                              **extra)

    @cached_property
    def _compiled_template(self):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)


def byte_level_backend(tokens: list[str], types: list[int], meta: dict[str, Any]) -> BackendTokenizer:
    """A "gpt2" vocabulary as transformers builds it (see the module's docstring)."""
    byte_chars = bytes_to_unicode()
    alphabet = set(byte_chars.values())
    # a token outside the byte alphabet is spelled as raw text in the file: re-spell its bytes
    vocab = {(t if set(t) <= alphabet else "".join(byte_chars[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>...) match whole and are special; a "control" token outside
    # the byte alphabet is a llama.cpp mislabel and is skipped, as transformers does
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    return backend


def sentencepiece_backend(tokens: list[str], scores: list[float], types: list[int], *, unk_token: str | None,
                          add_space_prefix: bool) -> BackendTokenizer:
    """A "llama" (SentencePiece) vocabulary as llama.cpp tokenizes it (llm_tokenizer_spm).

    llama.cpp spells each space "▁", puts one "▁" before the text (add_space_prefix), then starts
    from the text's characters and merges, again and again, the adjacent pair whose joined text is
    the best-scoring token, until no pair joins into a token; a character no token spells becomes
    the <0xNN> tokens of its UTF-8 bytes. A BPE whose merges are every cut of every token into two
    tokens, ranked by that token's score (best first), merges the same pairs in the same order
    (transformers builds the same: LlamaTokenizer with generate_merges), and byte_fallback gives the
    <0xNN> tokens. Where llama.cpp and transformers differ, this follows llama.cpp:
      - the "▁" goes before each run of text between added tokens, and before text that starts with
        a space too (transformers' Metaspace: only before the first run, and not before a space);
        a normalizer does this, as it runs on each run;
      - Gemma's scores rank its merges (transformers ranks them by token id, and respells its tokens
        of plain spaces, which llama.cpp never matches);
      - "<unk>" in the text is the unknown token, as are control tokens (llama.cpp's parse_special).
    Equal scores are the one place left where they can differ: llama.cpp merges the leftmost such
    pair, this BPE the pair of the lower token id. Trained vocabularies have distinct scores.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-scores[i], i, cut) for i, t in enumerate(tokens) for cut in range(1, len(t))
                    if t[:cut] in vocab and t[cut:] in vocab)
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True,
                                          byte_fallback=True))
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    backend.pre_tokenizer = None            # llama.cpp merges across the whole run: no word splits
    # "▁" -> " ", <0xNN> runs -> their characters, and the space put before the run dropped again
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    return backend


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """What encode(add_special_tokens=True) adds: BOS and/or EOS when the checkpoint asks for them."""
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)
