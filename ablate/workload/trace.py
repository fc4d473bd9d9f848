"""Request traces: one JSON object a line, replayed as a workload.

    {"arrival_time": 0.0, "prompt_len": 128, "output_len": 64}
    {"arrival_time": 0.35, "prompt": "Explain paging.", "output_len": 200}

arrival_time: seconds after the start, never decreasing; prompt (text, tokenised by the caller)
or prompt_len (tokens); output_len: tokens to generate. Blank lines are skipped. A bad line is a
ValueError naming the file, the line number and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("arrival_time", "prompt", "prompt_len", "output_len")


@dataclass(frozen=True)
class TraceEntry:
    line: int                      # 1-based line number in the file, for errors further on
    arrival_time: float            # seconds after the start
    output_len: int                # tokens to generate
    prompt_len: int | None = None  # tokens of a synthetic prompt, or
    prompt: str | None = None      # the prompt's text


class TraceError(ValueError):
    def __init__(self, path: str | Path, line: int, field: str | None, problem: str) -> None:
        where = f"{path}, line {line}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")
        self.path, self.line, self.field = str(path), line, field


def _count(path, line: int, obj: dict, field: str) -> int:
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, field, f"must be a whole number of tokens, got {value!r}")
    if value < 1:
        raise TraceError(path, line, field, f"must be >= 1, got {value}")
    return value


def read_trace(path: str | Path) -> list[TraceEntry]:
    """Every request of the trace, validated."""
    entries: list[TraceEntry] = []
    previous = 0.0
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise TraceError(path, line_no, None, f"not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, line_no, None, f"expected a JSON object, got {type(obj).__name__}")
            for key in obj:
                if key not in FIELDS:
                    raise TraceError(path, line_no, key, f"unknown key; the keys are {', '.join(FIELDS)}")
            for key in ("arrival_time", "output_len"):
                if key not in obj:
                    raise TraceError(path, line_no, key, "missing")
            arrival = obj["arrival_time"]
            if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
                raise TraceError(path, line_no, "arrival_time", f"must be a number of seconds, got {arrival!r}")
            if arrival < 0:
                raise TraceError(path, line_no, "arrival_time", f"must be >= 0, got {arrival}")
            if arrival < previous:
                raise TraceError(path, line_no, "arrival_time",
                                 f"{arrival} is earlier than the line before ({previous}): sort the trace by arrival")
            previous = float(arrival)
            has_text, has_len = "prompt" in obj, "prompt_len" in obj
            if has_text == has_len:
                raise TraceError(path, line_no, "prompt", "give exactly one of prompt (text) and prompt_len (tokens)")
            prompt = obj.get("prompt")
            if has_text and (not isinstance(prompt, str) or not prompt):
                raise TraceError(path, line_no, "prompt", f"must be non-empty text, got {prompt!r}")
            prompt_len = _count(path, line_no, obj, "prompt_len") if has_len else None
            entries.append(TraceEntry(line_no, float(arrival), _count(path, line_no, obj, "output_len"),
                                      prompt_len, prompt))
    if not entries:
        raise TraceError(path, 1, None, "the trace holds no request")
    return entries
