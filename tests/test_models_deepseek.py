"""DeepSeek-V2/V3 checkpoints (multi-head latent attention as published) against transformers.

Small random models built by transformers (ablate.testing.hf_models: every layer dense), saved and
loaded through ablate.checkpoints: logits, greedy text through the engine's caches with the absorbed
and the explicit decode, DeepSeek's routed experts, the KV bytes a token takes, and what is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ablate.checkpoints import load_model
from ablate.checkpoints.hf import CheckpointError
from ablate.measure.quality import sequence_logits
from ablate.model.mla import MultiHeadLatentAttention, set_absorbed
from ablate.testing.hf_models import greedy, hf_logits, pretrained, random_prompt, DEEPSEEK_MLA, SMALL, build_hf, save_hf

pytest.importorskip("transformers")

TOL = 1e-3               # max |logit difference| in fp32
NEW_TOKENS = 24
KINDS = ["deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "deepseek-v3-yarn"]









@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (transformers' model, the directory it is saved in), built once per module."""
    made = {}

    def get(kind: str, **shape):
        key = (kind, tuple(sorted(shape.items())))
        if key not in made:
            hf = build_hf(kind, **shape)
            made[key] = hf, save_hf(hf, tmp_path_factory.mktemp(kind), sharded=not shape)
        return made[key]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_a_deepseek_checkpoint_matches_transformers(kind, saved):
    hf, directory = saved(kind)
    model = load_model(pretrained(directory))
    cfg, hf_cfg = model.config, hf.config
    assert cfg.attention_kind == "mla" and cfg.latent_norms
    assert (cfg.head_dim, cfg.rope_head_dim, cfg.value_head_dim, cfg.kv_latent_dim) == (
        hf_cfg.qk_nope_head_dim, hf_cfg.qk_rope_head_dim, hf_cfg.v_head_dim, hf_cfg.kv_lora_rank)
    assert cfg.q_lora_rank == (hf_cfg.q_lora_rank or 0)
    assert (cfg.rope_yarn_scaling is not None) == kind.endswith("yarn")
    ids = random_prompt(12)
    diff = (sequence_logits(model, ids) - hf_logits(hf)(ids)).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit diff| {diff:.2e}"
    ours = []
    for _ in range(NEW_TOKENS):
        ours.append(int(sequence_logits(model, ids + ours)[-1].argmax()))
    assert ours == greedy(hf_logits(hf), ids, NEW_TOKENS)


def test_yarn_and_the_rotary_permutation_change_the_logits(saved):
    """What the test above checks is not vacuous: without YaRN's frequencies and scales, or without
    turning the interleaved rotary rows into halves, the logits differ."""
    ids = random_prompt(40)
    hf, directory = saved("deepseek-v3-yarn")
    yarn = load_model(pretrained(directory))
    plain = load_model(pretrained(directory))
    for layer in plain.layers:
        layer.attn.softmax_scale = (plain.config.head_dim + plain.config.rope_head_dim) ** -0.5
    plain.rope = type(plain.rope)(plain.config.rope_head_dim, plain.config.max_seq_len, plain.config.rope_base)
    assert (sequence_logits(yarn, ids) - sequence_logits(plain, ids)).abs().max() > 1e-2

    hf, directory = saved("deepseek-v3")
    notes = json.loads((directory / "config.json").read_text())
    notes["rope_interleave"] = False        # the same weights read as if already in halves: no permutation
    (directory / "config.json").write_text(json.dumps(notes))
    try:
        unpermuted = load_model(pretrained(directory))
    finally:
        notes["rope_interleave"] = True
        (directory / "config.json").write_text(json.dumps(notes))
    assert (sequence_logits(unpermuted, ids) - hf_logits(hf)(ids)).abs().max() > 1e-2


def test_deepseek_v3_without_interleaved_rope_reads_its_rows_as_they_are(saved):
    hf, directory = saved("deepseek-v3", rope_interleave=False)
    model = load_model(pretrained(directory))
    assert model.checkpoint_notes["rope_interleaved"] is False
    ids = random_prompt(12)
    assert (sequence_logits(model, ids) - hf_logits(hf)(ids)).abs().max().item() < TOL


def engine_greedy(build, make_requests, model, ids: list[int], kv_cache) -> list[int]:
    request = make_requests([len(ids)], [NEW_TOKENS])[0]
    request = type(request)(request.request_id, tuple(ids), NEW_TOKENS, request.sampling, ())
    (seq,) = build({"kv_cache": kv_cache}, model, record=False).engine.run([request])
    return seq.output_token_ids


@pytest.mark.parametrize("kv_cache", [pytest.param("none", marks=pytest.mark.slow), "contiguous",
                                      pytest.param({"name": "paged", "block_size": 4}, marks=pytest.mark.slow),
                                      pytest.param({"name": "dynamic", "initial_tokens": 4}, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["deepseek-v2", pytest.param("deepseek-v2-lite", marks=pytest.mark.slow),
                                  "deepseek-v3"])
def test_the_engine_decodes_transformers_greedy_text_absorbed_and_explicit(kind, kv_cache, saved, build,
                                                                           make_requests, monkeypatch):
    """Every decode step through the cache's latent rows: W_UK folded into the query and W_UV applied
    after attention (absorbed), or K and V up-projected for every cached token (explicit)."""
    hf, directory = saved(kind)
    ids = random_prompt(12, 2)
    expected = greedy(hf_logits(hf), ids, NEW_TOKENS)
    model = load_model(pretrained(directory))
    calls = []
    absorbed = MultiHeadLatentAttention.absorbed
    monkeypatch.setattr(MultiHeadLatentAttention, "absorbed", lambda self, *a: calls.append(1) or absorbed(self, *a))
    assert engine_greedy(build, make_requests, set_absorbed(model, True), ids, kv_cache) == expected
    decodes = len(calls)
    assert decodes >= (NEW_TOKENS - 1) * model.config.n_layers or kv_cache == "none"   # none: prefills only
    assert engine_greedy(build, make_requests, set_absorbed(model, False), ids, kv_cache) == expected
    assert len(calls) == decodes                                                       # never absorbed


def test_a_token_caches_the_latent_and_the_rotary_key_of_each_layer(saved, build):
    _, directory = saved("deepseek-v2")
    model = load_model(pretrained(directory))
    layers, latent, rope = SMALL["num_hidden_layers"], DEEPSEEK_MLA["kv_lora_rank"], DEEPSEEK_MLA["qk_rope_head_dim"]
    expected = layers * (latent + rope) * 4                                 # fp32
    assert model.config.kv_bytes_per_token() == expected
    cache = build({"kv_cache": "contiguous"}, model, max_num_seqs=2, max_seq_len=16).kv_cache
    assert cache.bytes_per_token == expected
    assert cache.bytes_reserved() == expected * 2 * 16                      # its buffers: every token slot
    # MHA would cache K (d_h + d_R) and V (d_v) per head: the latent is several times smaller
    mha = layers * SMALL["num_attention_heads"] * (
        DEEPSEEK_MLA["qk_nope_head_dim"] + rope + DEEPSEEK_MLA["v_head_dim"]) * 4
    assert expected * 4 < mha


@pytest.mark.parametrize("variant", [{"name": "gqa", "kv_heads": 1}, {"name": "mla", "rank": 8}])
def test_kv_conversions_of_a_deepseek_model_are_refused_naming_why(variant, saved, build):
    _, directory = saved("deepseek-v2")
    model = load_model(pretrained(directory))
    with pytest.raises(Exception, match="attention_kind=mla"):
        build({"kv_cache": "contiguous", "variant": variant}, model)


def edited(directory: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the checkpoint directory with config.json's fields changed."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for file in directory.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | changes))
    return copy


@pytest.mark.parametrize(("changes", "message"), [
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
    ({"first_k_dense_replace": 1, "num_experts_per_tok": 2, "topk_method": "noaux_tc"},
     r"topk_method 'noaux_tc' is not supported for deepseek_v2 \(greedy or group_limited_greedy\)"),
    ({"first_k_dense_replace": 1, "num_experts_per_tok": 2, "norm_topk_prob": True},
     r"norm_topk_prob=True is not supported for deepseek_v2"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     r"RoPE scaling 'dynamic' is not supported for deepseek_v2 \(only 'yarn', or none\)"),
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim must be even"),
    ({"kv_lora_rank": None}, r"config.json: kv_lora_rank must be a whole number > 0, got None"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
])
def test_what_cannot_run_is_refused_naming_the_field(changes, message, saved, tmp_path):
    _, directory = saved("deepseek-v2")
    with pytest.raises(CheckpointError, match=message):
        load_model(pretrained(edited(directory, tmp_path, **changes)))


# ---- chapter 13 on the published layout ---------------------------------------------------------

def test_the_presets_build_the_published_layout():
    from ablate.model.presets import preset
    from ablate.model.llama import LlamaModel
    tiny = LlamaModel.random(preset("deepseek-tiny"))
    attn = tiny.layers[0].attn
    assert attn.w_uq is not None and attn.q_norm is not None and attn.kv_norm is not None
    assert tiny.config.kv_bytes_per_token() == 2 * (16 + 8) * 4
    assert sum(p.numel() for p in tiny.parameters()) == tiny.config.num_params()
    lite = preset("deepseek-v2-lite-shaped")
    assert lite.kv_bytes_per_token(4) == 4 * (512 + 64) * 4 and lite.q_lora_rank == 0


@pytest.mark.slow
def test_the_ch13_deepseek_experiment_measures_the_kv_bytes_it_predicts(compose_config, registry, tmp_path):
    """A whole run on deepseek-tiny: the cache's buffers per token equal the formula for both arms,
    and the MLA arm holds (d_c + d_R) / (H (d_h + d_R + d_v)) of MHA's."""
    import pandas as pd

    from ablate.book.chapter_tables import table_name
    from ablate.book.tables.ch13_kv_bytes import HEADING
    from ablate.experiment.job import run_job

    raw = compose_config(tmp_path, "+experiment=ch13_mla_deepseek", "model=deepseek-tiny", "wandb.mode=disabled",
                         "kv_cache.budget_bytes=0", "experiment.repeats=1", "experiment.warmup=0",
                         "workload.num_requests=2", "workload.prompt_len=8", "workload.output_len=3")
    folder = run_job(raw, registry)
    table = pd.read_csv(folder.path / f"{table_name(HEADING)}.csv").set_index("arm")
    assert (table["measured_vs_predicted"] == 1.0).all()
    assert table.loc["mla", "kv_bytes_per_token"] == 2 * (16 + 8) * 4
    assert table.loc["mla", "token_slots_reserved"] == 8 * 11          # max_num_seqs x (8 + 3) tokens
    assert table.loc["mla", "vs_mha_equivalent"] == pytest.approx((16 + 8) / (4 * (16 + 8 + 12)), abs=1e-4)
    assert table.loc["mla", "kv_layout"] == "mla: latent 16 + rotary 8"


def test_the_ch13_deepseek_budget_is_two_mha_sequences(compose_config, tmp_path):
    from ablate.model.presets import preset
    raw = compose_config(tmp_path, "+experiment=ch13_mla_deepseek")
    twin = preset("deepseek-v2-lite-shaped", **raw["experiment"]["arms"]["mha"]["model"])
    mla = preset("deepseek-v2-lite-shaped")
    tokens = raw["workload"]["prompt_len"] + raw["workload"]["output_len"]
    assert twin.kv_bytes_per_token(4) == 4 * 16 * (128 + 64 + 128) * 4      # DeepSeek's K and V, up-projected
    assert raw["kv_cache"]["budget_bytes"] == 2 * tokens * twin.kv_bytes_per_token(4)
    assert raw["kv_cache"]["budget_bytes"] // (tokens * mla.kv_bytes_per_token(4)) == 17


def test_the_kv_bytes_table_predicts_the_converted_smollm2_arms(compose_config, tmp_path):
    """Beside DeepSeek's own layout, chapter 13's SmolLM2 arms: MHA (9 K/V heads), as shipped (3),
    MQA (1) and MLA converted by SVD (latent r + rotary 2 f x 3 heads), 30 layers of 64-dim heads."""
    import pandas as pd

    from ablate.book.tables.ch13_kv_bytes import HEADING, analytic_tables
    raw = compose_config(tmp_path, "+experiment=ch13_gqa_mla")
    measured = {"mha": 138240, "gqa3": 46080, "mqa": 15360, "mla_r128": 26880, "mla_r64": 13440}
    summary = pd.DataFrame({"arm": list(measured), "kv_bytes_per_token": list(measured.values()), "dtype": "fp32"})
    table = analytic_tables(raw, summary)[HEADING].set_index("arm")
    assert (table["measured_vs_predicted"] == 1.0).all(), table
    assert (table["kv_bytes_mha_equivalent"] == 138240).all()
    assert table.loc["mla_r64", "kv_layout"] == "mla: latent 64 + rotary 48"


def test_a_llama_checkpoint_loaded_over_an_mla_preset_is_the_llama(tmp_path):
    """The checkpoint's shape replaces the preset's, MLA fields included."""
    from ablate.model.presets import preset
    directory = save_hf(build_hf("llama-untied"), tmp_path / "llama", sharded=False)
    model = load_model(preset("deepseek-tiny", init="pretrained", path=str(directory)))
    assert model.config.attention_kind == "mha" and not model.config.latent_norms
    assert model.config.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


@pytest.mark.parametrize(("variant", "why"), [("variant=gqa", "variant=gqa converts per-head K/V projections"),
                                              ("variant=mla", "variant=mla converts Llama-family K/V projections")])
def test_a_kv_conversion_of_a_deepseek_checkpoint_is_refused_before_it_loads(variant, why, saved, compose_config,
                                                                             registry, tmp_path, monkeypatch):
    from ablate.checkpoints import loader
    from ablate.experiment.job import run_job
    _, directory = saved("deepseek-v2")
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(loader.LlamaModel, "from_hf_state_dict", lambda *a, **k: pytest.fail("weights were read"))
    raw = compose_config(tmp_path, f"model.path={directory}", variant, "wandb.mode=disabled")
    with pytest.raises(ValueError, match=rf"arm '.*': {why}.*attention_kind=mla.*variant=none"):
        run_job(raw, registry)
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("done.json"))


# ---- DeepSeek's mixture of experts ----------------------------------------------------------------

def with_random_score_bias(hf):
    """V3's e_score_correction_bias is a buffer (zeros as built): random, so that a misread one shows."""
    g = torch.Generator().manual_seed(3)
    for layer in hf.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=g))
    return hf


@pytest.mark.parametrize(("kind", "shape"), [("deepseek-v2-moe", {}), ("deepseek-v2-moe", {"topk_method": "greedy"}),
                                             ("deepseek-v3-moe", {})])
def test_deepseek_experts_match_transformers(kind, shape, tmp_path, build, make_requests):
    from ablate.model.deepseek_moe import DeepSeekExperts
    hf = with_random_score_bias(build_hf(kind, **shape))
    model = load_model(pretrained(save_hf(hf, tmp_path / kind)))
    assert isinstance(model.layers[1].mlp, DeepSeekExperts) and not isinstance(model.layers[0].mlp, DeepSeekExperts)
    assert model.config.moe_groups == (0 if shape else hf.config.n_group)
    ids = random_prompt(12)
    diff = (sequence_logits(model, ids) - hf_logits(hf)(ids)).abs().max().item()
    assert diff < TOL, f"{kind} {shape}: max |logit diff| {diff:.2e}"
    assert engine_greedy(build, make_requests, model, ids, "contiguous") == greedy(hf_logits(hf), ids, NEW_TOKENS)


def test_deepseek_routing_keeps_to_the_best_groups_and_v3s_bias_only_chooses():
    from ablate.model.deepseek_moe import deepseek_top_k
    logits = torch.tensor([[4.0, 0.0, 3.9, 3.8, 0.1, 0.2, 0.3, 0.4]])       # groups of 2: (4, 0) (3.9, 3.8) ...
    _, ids = deepseek_top_k(logits, 2, sigmoid=False, score_bias=None, groups=4, topk_groups=1, normalise=False,
                            scale=1.0)
    assert sorted(ids[0].tolist()) == [0, 1]                 # V2: the group with the best expert, both of its
    _, ids = deepseek_top_k(logits, 2, sigmoid=False, score_bias=None, groups=0, topk_groups=0, normalise=False,
                            scale=1.0)
    assert sorted(ids[0].tolist()) == [0, 2]                 # greedy: the best two anywhere
    _, ids = deepseek_top_k(logits, 2, sigmoid=True, score_bias=None, groups=4, topk_groups=1, normalise=False,
                            scale=1.0)
    assert sorted(ids[0].tolist()) == [2, 3]                 # V3: the group whose best two sum highest
    bias = torch.tensor([0.0, 0.0, -5.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    weights, ids = deepseek_top_k(logits, 2, sigmoid=True, score_bias=bias, groups=0, topk_groups=0,
                                  normalise=False, scale=2.0)
    assert 2 not in ids[0].tolist()                          # the bias moves the choice...
    assert torch.allclose(weights[0], 2.0 * logits[0, ids[0]].sigmoid())   # ... not the weights


def test_a_deepseek_moe_model_counts_its_parameters(tmp_path):
    hf = build_hf("deepseek-v3-moe")
    model = load_model(pretrained(save_hf(hf, tmp_path / "v3", sharded=False)))
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()
    assert model.config.num_params() == sum(p.numel() for p in hf.parameters()) + model.config.num_moe_layers * 8
