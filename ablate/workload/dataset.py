"""Prompts users bring, as a workload (workload.source=dataset, workload.dataset_path).

Two formats, told apart by the keys of the file's first record:

  ShareGPT: a JSON list, or JSONL, of conversations
        {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}
    ("messages" is read for "conversations", and "role"/"content" for "from"/"value"). The prompt is
    the first human (user) turn; the reference reply, the next gpt (assistant) turn after it, gives
    the output length: its token count, as vLLM's benchmark_serving does for ShareGPT, capped at
    workload.output_len_max when that is > 0. The count is the model's tokenizer's, or that of
    workload.count_tokenizer (a tokenizer.json) to count as another model's tokenizer would.
  prompts: JSONL, one {"prompt": "...", "output_len": 64} a line; output_len (tokens) is optional,
    workload.output_len when absent.

The prompt text is encoded by the model's tokenizer as it is (no chat template), as vLLM's
benchmark does. A record whose prompt or reply is empty (or that has no human turn with a reply
after it) is skipped, and so is one whose prompt + output tokens do not fit the model's context:
never truncated, as vLLM's ShareGPT sampler does. The records are shuffled with workload.seed and
the requests are the first workload.num_requests usable ones: the same seed gives the same requests.
Fewer usable records than num_requests is a ValueError naming the file and the counts; a malformed
file is a ValueError naming the file, the line (JSONL) or record (a JSON list), and what is wrong.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ablate.workload.requests import WorkloadConfig

CONVERSATION_KEYS = ("conversations", "messages")
ROLE_KEYS, TEXT_KEYS = ("from", "role"), ("value", "content")
HUMAN_ROLES = ("human", "user")
REPLY_ROLES = ("gpt", "assistant", "chatgpt", "model")
PROMPT_FIELDS = ("prompt", "output_len")
SHAREGPT_EXAMPLE = '{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}'
PROMPT_EXAMPLE = '{"prompt": "...", "output_len": 64}'

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetRecord:
    where: str                     # "line 3" (JSONL) or "record 3" (a JSON list), 1-based, for messages
    prompt: str                    # the first human turn, or the prompt ("" when there is none)
    reply: str | None = None       # ShareGPT: the reference reply ("" when there is none)
    output_len: int | None = None  # prompts JSONL: tokens to generate, when the line gives them


@dataclass
class DatasetSample:
    """What a workload took from the file: (prompt tokens, output tokens) per request, and why others were not."""
    requests: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    num_examined: int = 0          # records looked at before num_requests usable ones were found
    num_empty: int = 0             # skipped: an empty prompt or reply
    num_too_long: int = 0          # skipped: prompt + output tokens beyond the model's context


def _error(path: str | Path, where: str, problem: str) -> ValueError:
    return ValueError(f"{path}" + (f", {where}" if where else "") + f": {problem}")


def _parse_json(path: str | Path, where: str, text: str) -> Any:
    """The JSON value of `text` (a line, or the whole file: `where` is then "" and the error names the line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = where or f"line {err.lineno}"
        raise _error(path, where, f"not valid JSON ({err.msg} at column {err.colno}); expected a JSON list of "
                     f"conversations or one JSON object a line, e.g. {SHAREGPT_EXAMPLE}") from None


def _raw_records(path: str | Path) -> list[tuple[str, Any]]:
    """(where, parsed value) of each record: the items of a JSON list, or the non-blank lines of JSONL."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise _error(path, "", "the dataset file does not exist (workload.dataset_path)") from None
    except OSError as err:
        raise _error(path, "", f"cannot read the dataset file: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise _error(path, f"line {line}", f"not UTF-8 text (byte 0x{data[err.start]:02x}): save the file as "
                     "UTF-8") from None
    if not text.strip():
        raise _error(path, "", f"the file is empty: expected a JSON list of conversations ({SHAREGPT_EXAMPLE}) or "
                     f"JSONL, one object a line ({PROMPT_EXAMPLE})")
    if text.lstrip().startswith("["):
        items = _parse_json(path, "", text)
        return [(f"record {i}", item) for i, item in enumerate(items, start=1)]
    return [(f"line {n}", _parse_json(path, f"line {n}", line)) for n, line in enumerate(text.splitlines(), 1)
            if line.strip()]


def _turn(path: str | Path, where: str, turn: Any) -> tuple[str, str]:
    """(role, text) of one ShareGPT turn."""
    if not isinstance(turn, dict):
        raise _error(path, where, f"expected an object with from/value (or role/content), got {type(turn).__name__}")
    role_key = next((k for k in ROLE_KEYS if k in turn), None)
    text_key = next((k for k in TEXT_KEYS if k in turn), None)
    if role_key is None or text_key is None:
        raise _error(path, where, f"a turn needs 'from' and 'value' (or 'role' and 'content'); it has "
                     f"{', '.join(map(repr, turn)) or 'no keys'}")
    role, text = turn[role_key], turn[text_key]
    if not isinstance(role, str) or not isinstance(text, str):
        raise _error(path, where, f"{role_key!r} and {text_key!r} must be text, got {role!r} and "
                     f"{type(text).__name__}")
    return role.lower(), text


def _sharegpt_record(path: str | Path, where: str, obj: dict) -> DatasetRecord:
    key = next((k for k in CONVERSATION_KEYS if k in obj), None)
    if key is None:
        raise _error(path, where, f"no 'conversations' (or 'messages') list; a ShareGPT record is {SHAREGPT_EXAMPLE}")
    turns = obj[key]
    if not isinstance(turns, list):
        raise _error(path, where, f"{key!r} must be a list of turns, got {type(turns).__name__}")
    parsed = [_turn(path, f"{where}, turn {k}", t) for k, t in enumerate(turns, start=1)]
    human = next((k for k, (role, _) in enumerate(parsed) if role in HUMAN_ROLES), None)
    if human is None:
        return DatasetRecord(where, "", "")
    reply = next((text for role, text in parsed[human + 1:] if role in REPLY_ROLES), "")
    return DatasetRecord(where, parsed[human][1], reply)


def _prompt_record(path: str | Path, where: str, obj: dict) -> DatasetRecord:
    unknown = [k for k in obj if k not in PROMPT_FIELDS]
    if unknown:
        raise _error(path, where, f"unknown key {unknown[0]!r}; a prompt line has {' and '.join(PROMPT_FIELDS)}: "
                     f"{PROMPT_EXAMPLE}")
    prompt, output_len = obj.get("prompt"), obj.get("output_len")
    if not isinstance(prompt, str):
        raise _error(path, where, f"'prompt' must be text, got {prompt!r}")
    if output_len is not None and (isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1):
        raise _error(path, where, f"'output_len' must be a whole number of tokens >= 1, got {output_len!r}")
    return DatasetRecord(where, prompt, None, output_len)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, mtime_ns: int, size: int) -> tuple[DatasetRecord, ...]:
    raw = _raw_records(path)
    if not raw:
        raise _error(path, "", "holds no record (an empty list)")
    records = []
    for where, obj in raw:
        if not isinstance(obj, dict):
            raise _error(path, where, f"expected a JSON object, got {type(obj).__name__}")
        if not records:      # the first record decides the format of the whole file
            is_sharegpt = any(k in obj for k in CONVERSATION_KEYS)
            if not is_sharegpt and "prompt" not in obj:
                raise _error(path, where, f"neither a ShareGPT conversation ({SHAREGPT_EXAMPLE}) nor a prompt "
                             f"({PROMPT_EXAMPLE}): it has {', '.join(map(repr, obj)) or 'no keys'}")
        records.append(_sharegpt_record(path, where, obj) if is_sharegpt else _prompt_record(path, where, obj))
    return tuple(records)


def read_dataset(path: str | Path) -> tuple[DatasetRecord, ...]:
    """Every record of the file, validated (read once per file version: a ShareGPT dump is large)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return _read_cached(str(path), 0, 0)     # _raw_records says what is wrong with the path
    return _read_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _count_tokenizer_at(path: str, mtime_ns: int):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:     # the tokenizers package raises a bare Exception for a bad file
        raise ValueError(f"workload.count_tokenizer={path}: not a tokenizer.json the tokenizers package can "
                         f"read ({err})") from None


def reply_counter(cfg: WorkloadConfig, tokenizer):
    """text -> its number of tokens: by workload.count_tokenizer when set, else by the model's tokenizer."""
    if not cfg.count_tokenizer:
        return lambda text: len(tokenizer.encode(text))
    path = Path(cfg.count_tokenizer)
    if not path.is_file():
        raise ValueError(f"workload.count_tokenizer={cfg.count_tokenizer}: no such file; give the path of a "
                         "tokenizer.json (or leave it empty to count with the model's tokenizer)")
    counting = _count_tokenizer_at(str(path), path.stat().st_mtime_ns)
    return lambda text: len(counting.encode(text, add_special_tokens=False).ids)


def dataset_prompts(cfg: WorkloadConfig, tokenizer, vocab_size: int, max_seq_len: int | None) -> DatasetSample:
    """The workload's num_requests requests from cfg.dataset_path: the first usable records after
    a shuffle seeded by cfg.seed, prompts encoded by `tokenizer` (anything with encode(text) ->
    token ids), output lengths as the module docstring says."""
    if tokenizer is None:
        raise ValueError("workload.source=dataset needs the model's tokenizer to encode the prompts, and none was "
                         "given (a model with a checkpoint: model.path or model.package)")
    records = read_dataset(cfg.dataset_path)
    count = reply_counter(cfg, tokenizer)
    sample = DatasetSample()
    for index in np.random.default_rng(cfg.seed).permutation(len(records)):
        if len(sample.requests) == cfg.num_requests:
            break
        record = records[index]
        sample.num_examined += 1
        if not record.prompt.strip() or (record.reply is not None and not record.reply.strip()):
            sample.num_empty += 1
            continue
        prompt = tuple(tokenizer.encode(record.prompt))
        if record.reply is not None:
            output_len = count(record.reply)
            output_len = min(output_len, cfg.output_len_max) if cfg.output_len_max > 0 else output_len
        else:
            output_len = record.output_len or cfg.output_len
        if not prompt or output_len < 1:
            sample.num_empty += 1
            continue
        if max(prompt) >= vocab_size:
            raise _error(cfg.dataset_path, record.where, f"the prompt encodes to token {max(prompt)}, beyond the "
                         f"model's vocabulary of {vocab_size}: the tokenizer is not the model's")
        if max_seq_len and len(prompt) + output_len > max_seq_len:
            sample.num_too_long += 1
            continue
        sample.requests.append((prompt, output_len))
    if len(sample.requests) < cfg.num_requests:
        raise _error(cfg.dataset_path, "", f"{len(sample.requests)} usable records of {len(records)}, fewer than "
                     f"workload.num_requests={cfg.num_requests} ({sample.num_empty} with an empty prompt or reply, "
                     f"{sample.num_too_long} longer than model.max_seq_len={max_seq_len}): lower num_requests or "
                     "give a larger file")
    log.info("%s: %d requests from %d records examined (%d skipped empty, %d skipped too long)", cfg.dataset_path,
             len(sample.requests), sample.num_examined, sample.num_empty, sample.num_too_long)
    return sample
