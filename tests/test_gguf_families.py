"""GGUF files of the model families llama.cpp defines, read into ablate: each written from a random
transformers model the way convert_hf_to_gguf.py writes it (ablate.testing.gguf_writer), proven to be
llama.cpp's layout by llama.cpp itself (llama-cpp-python, in a subprocess: a crash there must not
take pytest down), then loaded by ablate and compared with transformers on the source model: logits
and greedy tokens through the engine.

The cases, and what each changes to what a GGUF can say: ablate.testing.gguf_cases.
"""
from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest

from ablate.checkpoints import load_model
from ablate.measure.quality import sequence_logits
from ablate.testing.gguf_cases import CASES, case_model, llama_cpp_logits, spread_error
from ablate.testing.gguf_writer import write_gguf
from ablate.testing.hf_models import greedy, hf_logits, pretrained, random_prompt

pytest.importorskip("transformers")

TOL = 1e-3              # max |logit difference| / the logits' spread, fp32
NEW_TOKENS = 16
PROMPT = random_prompt(12)

# llama.cpp takes ~3 s a file to start: two families by default, the rest slow
LLAMA_CPP_DEFAULT = ("qwen2-moe", "deepseek-v3-moe")


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (pip install llama-cpp-python)")


@needs_llama_cpp
@pytest.mark.parametrize("case, split_kv_b", [
    *(pytest.param(case, False, marks=() if case in LLAMA_CPP_DEFAULT else pytest.mark.slow) for case in CASES),
    *(pytest.param(case, True, marks=pytest.mark.slow) for case in CASES if case.startswith("deepseek"))])
def test_llama_cpp_runs_the_written_gguf_as_transformers_runs_the_model(case, split_kv_b, tmp_path):
    """The writer is llama.cpp's layout: llama.cpp 0.3.36 gives transformers' logits from its file
    (DeepSeek's in both of its converters' layouts)."""
    hf = case_model(case)
    path = write_gguf(hf, tmp_path / f"{case}.gguf", split_kv_b=split_kv_b)
    expected = hf_logits(hf)(PROMPT).numpy()
    assert spread_error(llama_cpp_logits(path, PROMPT, tmp_path / "logits.npy"), expected) < TOL


@pytest.mark.parametrize("case", CASES)
def test_ablate_reads_the_gguf_as_transformers_runs_the_model(case, build, make_requests, tmp_path):
    """Logits within 1e-3 of their spread, and greedy tokens identical through the engine."""
    hf = case_model(case)
    model = load_model(pretrained(write_gguf(hf, tmp_path / f"{case}.gguf")))
    assert model.checkpoint_notes["format"] == "gguf"
    expected = hf_logits(hf)(PROMPT)
    assert spread_error(sequence_logits(model, PROMPT).float().numpy(), expected.numpy()) < TOL
    request = make_requests([len(PROMPT)], [NEW_TOKENS])[0]
    request = type(request)(request.request_id, tuple(PROMPT), NEW_TOKENS, request.sampling, ())
    (seq,) = build({"kv_cache": "contiguous"}, model, record=False).engine.run([request])
    assert seq.output_token_ids == greedy(hf_logits(hf), PROMPT, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek-v2", "deepseek-v3-moe"])
def test_deepseek_kv_b_split_by_newer_converters_is_joined_back(case, tmp_path):
    hf = case_model(case)
    model = load_model(pretrained(write_gguf(hf, tmp_path / f"{case}.gguf", split_kv_b=True)))
    assert spread_error(sequence_logits(model, PROMPT).float().numpy(), hf_logits(hf)(PROMPT).numpy()) < TOL


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, name", [("qwen2-moe", "blk.1.ffn_up_exps.weight"),
                                        ("gemma2", "blk.2.post_ffw_norm.weight"),
                                        ("deepseek-v3-moe", "blk.1.exp_probs_b.bias")])
@pytest.mark.parametrize("fault", ["drop", "reshape"])
def test_a_missing_or_misshaped_tensor_is_named(case, name, fault, tmp_path):
    def edit(gguf_name: str, array: np.ndarray) -> np.ndarray | None:
        if gguf_name != name:
            return array
        return None if fault == "drop" else array[..., :-1].copy()

    path = write_gguf(case_model(case), tmp_path / "bad.gguf", edit=edit)
    with pytest.raises(ValueError) as e:
        load_model(pretrained(path))
    assert str(path) in str(e.value) and repr(name) in str(e.value)
    assert ("missing" if fault == "drop" else "shape") in str(e.value)


def test_a_tensor_holding_nan_is_named(tmp_path):
    name = "blk.0.ffn_gate_exps.weight"
    path = write_gguf(case_model("mixtral"), tmp_path / "nan.gguf",
                      edit=lambda n, a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a).astype(np.float32)
                      if n == name else a)
    with pytest.raises(ValueError, match=rf"{name!r} holds 1 NaN"):
        load_model(pretrained(path))


def test_an_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as e:
        load_model(pretrained(path))
    message = str(e.value)
    assert str(path) in message and "'falcon'" in message and "Hugging Face checkpoint directory" in message
    for arch in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "deepseek2"):
        assert repr(arch) in message


def test_missing_metadata_names_the_key(tmp_path):
    path = write_gguf(case_model("qwen3"), tmp_path / "q.gguf")
    data = path.read_bytes()
    key = b"qwen3.attention.layer_norm_rms_epsilon"
    path.write_bytes(data.replace(key, b"qwen3.attention.layer_norm_rms_epsiloX"))   # same length: still a GGUF
    with pytest.raises(ValueError, match=r"missing metadata key 'qwen3\.attention\.layer_norm_rms_epsilon'"):
        load_model(pretrained(path))
