"""Request traces: one JSON object a line, replayed as a workload.

    {"arrival_time": 0.0, "prompt_len": 128, "output_len": 64}
    {"arrival_time": 0.35, "prompt": "Explain paging.", "output_len": 200}

arrival_time: seconds, never decreasing; prompt (text, tokenised by the caller) or prompt_len
(tokens); output_len: tokens to generate. Blank lines are skipped. Arrival times are relative: the
first request's time is subtracted from every line's, so a trace logged with Unix times (1.76e9 s)
replays from 0 as one logged from 0 does; a trace that spans more than MAX_SPAN_S (a day: times in
milliseconds?) is refused. A bad line (or a file that is not UTF-8) is a ValueError naming the file,
the line number and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("arrival_time", "prompt", "prompt_len", "output_len")
MAX_SPAN_S = 86_400.0    # the longest time from the first to the last arrival: a day


@dataclass(frozen=True)
class TraceEntry:
    line: int                      # 1-based line number in the file, for errors further on
    arrival_time: float            # seconds after the first request of the trace
    output_len: int                # tokens to generate
    prompt_len: int | None = None  # tokens of a synthetic prompt, or
    prompt: str | None = None      # the prompt's text


class TraceError(ValueError):
    def __init__(self, path: str | Path, line: int, field: str | None, problem: str) -> None:
        where = f"{path}" + (f", line {line}" if line else "") + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")
        self.path, self.line, self.field = str(path), line, field


def _count(path, line: int, obj: dict, field: str) -> int:
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, field, f"must be a whole number of tokens, got {value!r}")
    if value < 1:
        raise TraceError(path, line, field, f"must be >= 1, got {value}")
    return value


def _lines(path: str | Path):
    """(line number, text) of every line, decoded as UTF-8; a TraceError names the file, line and byte."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TraceError(path, 0, None, "the trace file does not exist (workload.trace_path)") from None
    except OSError as err:
        raise TraceError(path, 0, None, f"cannot read the trace file: {err.strerror or err}") from None
    offset = 0
    for line_no, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            yield line_no, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TraceError(path, line_no, None, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at byte offset "
                             f"{offset + err.start} of the file): save the trace as UTF-8") from None
        offset += len(raw)


def _parse(path, line_no: int, text: str) -> dict:
    text = text.rstrip()      # the newline, so that an unclosed object is not reported on "line 2, column 1"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        if err.pos >= len(text):
            problem = f"the line ends before its JSON value does ({err.msg}: a missing '}}' or '\"'?)"
        else:
            problem = f"{err.msg} at character {err.pos + 1}: {text[max(0, err.pos - 20):err.pos + 20]!r}"
        raise TraceError(path, line_no, None, f"not valid JSON: {problem}") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line_no, None, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_trace(path: str | Path) -> list[TraceEntry]:
    """Every request of the trace, validated, its arrival times relative to the first request's."""
    entries: list[TraceEntry] = []
    previous = first = 0.0
    for line_no, text in _lines(path):
        if not text.strip():
            continue
        obj = _parse(path, line_no, text)
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
        if not entries:
            previous = first = float(arrival)
        if arrival < previous:
            raise TraceError(path, line_no, "arrival_time",
                             f"{arrival} is earlier than the line before ({previous}): sort the trace by arrival")
        if arrival - first > MAX_SPAN_S:
            raise TraceError(path, line_no, "arrival_time",
                             f"{arrival} is {arrival - first:.0f} s after the first request's {first}: a trace "
                             f"may span at most {MAX_SPAN_S:.0f} s (a day); arrival times are seconds (not "
                             "milliseconds)")
        previous = float(arrival)
        has_text, has_len = "prompt" in obj, "prompt_len" in obj
        if has_text == has_len:
            raise TraceError(path, line_no, "prompt", "give exactly one of prompt (text) and prompt_len (tokens)")
        prompt = obj.get("prompt")
        if has_text and (not isinstance(prompt, str) or not prompt):
            raise TraceError(path, line_no, "prompt", f"must be non-empty text, got {prompt!r}")
        prompt_len = _count(path, line_no, obj, "prompt_len") if has_len else None
        entries.append(TraceEntry(line_no, float(arrival) - first, _count(path, line_no, obj, "output_len"),
                                  prompt_len, prompt))
    if not entries:
        raise TraceError(path, 1, None, "the trace holds no request")
    return entries
