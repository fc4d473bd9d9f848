"""Trace replay and the textbook workload: requests from a JSONL file, and errors that name the file,
the line and the field."""
from __future__ import annotations

import json
import re

import pytest

from ablate.workload.requests import TEXTBOOK_OUTPUT_LENS, WorkloadConfig, make_requests
from ablate.workload.trace import read_trace


def write(tmp_path, lines: list[str]):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [
    json.dumps({"arrival_time": 0.0, "prompt_len": 5, "output_len": 3}),
    "",                                                                   # blank lines are skipped
    json.dumps({"arrival_time": 0.25, "prompt_len": 2, "output_len": 7}),
    json.dumps({"arrival_time": 0.25, "prompt": "hi there", "output_len": 1}),
]


class WordTokenizer:
    """Anything with encode(text) -> token ids will do."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_a_trace_replays_its_arrivals_and_lengths(tmp_path):
    cfg = WorkloadConfig(arrival="trace", trace_path=str(write(tmp_path, GOOD)), num_requests=99)
    requests = make_requests(cfg, vocab_size=50, tokenizer=WordTokenizer())
    assert [r.arrival_time for r in requests] == [0.0, 0.25, 0.25]
    assert [len(r.prompt_token_ids) for r in requests] == [5, 2, 2]
    assert [r.max_new_tokens for r in requests] == [3, 7, 1]
    assert requests[2].prompt_token_ids == (2, 5)
    assert all(0 <= t < 50 for r in requests for t in r.prompt_token_ids)
    assert make_requests(cfg, vocab_size=50, tokenizer=WordTokenizer()) == requests     # seeded
    assert [e.line for e in read_trace(cfg.trace_path)] == [1, 3, 4]


@pytest.mark.parametrize("line, field, message", [
    ('{"arrival_time": 0.5, "prompt_len": -4, "output_len": 3}', "prompt_len", "must be >= 1, got -4"),
    ('{"arrival_time": 0.5, "prompt_len": 4, "output_len": 0}', "output_len", "must be >= 1, got 0"),
    ('{"arrival_time": -1, "prompt_len": 4, "output_len": 3}', "arrival_time", "must be >= 0"),
    ('{"arrival_time": 0.1, "prompt_len": 4, "output_len": 3}', "arrival_time", "earlier than the line before"),
    ('{"arrival_time": 0.5, "prompt_len": 4, "output_len": 3, "priority": 1}', "priority", "unknown key"),
    ('{"arrival_time": 0.5, "prompt_len": 4.5, "output_len": 3}', "prompt_len", "whole number"),
    ('{"arrival_time": 0.5, "prompt_len": true, "output_len": 3}', "prompt_len", "whole number"),
    ('{"arrival_time": "soon", "prompt_len": 4, "output_len": 3}', "arrival_time", "number of seconds"),
    ('{"arrival_time": 0.5, "output_len": 3}', "prompt", "exactly one of prompt"),
    ('{"arrival_time": 0.5, "prompt": "x", "prompt_len": 4, "output_len": 3}', "prompt", "exactly one of prompt"),
    ('{"arrival_time": 0.5, "prompt": "", "output_len": 3}', "prompt", "non-empty text"),
    ('{"arrival_time": 0.5, "prompt_len": 4}', "output_len", "missing"),
    ('{"arrival_time": 0.5, "prompt_len": 4, "output_len": 3', None, "not valid JSON"),
    ('[0.5, 4, 3]', None, "expected a JSON object"),
])
def test_a_bad_line_names_the_file_the_line_and_the_field(tmp_path, line, field, message):
    path = write(tmp_path, [json.dumps({"arrival_time": 0.2, "prompt_len": 3, "output_len": 2}), line])
    where = f"{path}, line 2" + (f", field '{field}'" if field else "")
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: .*{message}"):
        read_trace(path)
    with pytest.raises(ValueError, match="line 2"):     # the same through the workload
        make_requests(WorkloadConfig(arrival="trace", trace_path=str(path)), vocab_size=50)


def test_prompt_text_without_a_tokenizer_names_the_line(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ValueError, match=r"line 4, field 'prompt': prompt text needs the model's tokenizer"):
        make_requests(WorkloadConfig(arrival="trace", trace_path=str(path)), vocab_size=50)


def test_trace_settings_are_checked():
    with pytest.raises(ValueError, match="arrival=trace needs workload.trace_path"):
        WorkloadConfig(arrival="trace")
    with pytest.raises(ValueError, match="trace_path is only read with workload.arrival=trace"):
        WorkloadConfig(trace_path="x.jsonl")


def test_an_empty_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"trace.jsonl, line 1: the trace holds no request"):
        read_trace(write(tmp_path, ["", "  "]))


def test_the_textbook_case():
    requests = make_requests(WorkloadConfig(arrival="textbook", prompt_len=6, output_len=80, textbook_arrival_s=0.5),
                             vocab_size=100)
    assert [r.max_new_tokens for r in requests] == [*TEXTBOOK_OUTPUT_LENS, 80] == [500, 450, 100, 80]
    assert [r.arrival_time for r in requests] == [0.0, 0.0, 0.0, 0.5]
    assert all(len(r.prompt_token_ids) == 6 for r in requests)


def test_the_textbook_case_scaled_down_keeps_the_proportions():
    scaled = WorkloadConfig(arrival="textbook", prompt_len=6, output_len=20, textbook_scale=0.2)
    assert [r.max_new_tokens for r in make_requests(scaled, vocab_size=100)] == [100, 90, 20, 20]
    tiny = WorkloadConfig(arrival="textbook", output_len=1, textbook_scale=0.001)     # never below one token
    assert [r.max_new_tokens for r in make_requests(tiny, vocab_size=100)] == [1, 1, 1, 1]
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match=r"workload.textbook_scale must be a finite number > 0"):
            WorkloadConfig(arrival="textbook", textbook_scale=bad)
