"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): this engine's logits and greedy
text against transformers' on the same random weights, with the experts computed each way
(engine.moe_experts: loop, grouped), through the engine's caches; the hub's per-expert tensor names
and transformers' fused 3-D ones; bad expert settings refused by name; the active parameter count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ablate.checkpoints import load_model
from ablate.checkpoints.hf import hf_model_fields
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.measure.quality import sequence_logits
from ablate.model.config import ModelConfig
from ablate.testing.hf_models import greedy, hf_logits, pretrained, random_prompt, build_hf, save_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-3               # max |logit difference| in fp32
NEW_TOKENS = 24
KINDS = ["mixtral", "qwen2-moe", "qwen3-moe"]
STRATEGIES = ["loop", "grouped"]








@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (transformers' model, its saved directory), built once for the module."""
    out = {}
    for kind in KINDS:
        hf = build_hf(kind)
        out[kind] = hf, save_hf(hf, tmp_path_factory.mktemp(kind) / kind)
    return out


EXPECTED_FIELDS = {
    "mixtral": dict(n_experts=4, n_experts_per_token=2, expert_d_ff=96, shared_expert_d_ff=0, norm_topk_prob=True,
                    dense_layers=None, qkv_bias=False, qk_norm=False),
    "qwen2-moe": dict(n_experts=4, n_experts_per_token=2, expert_d_ff=32, shared_expert_d_ff=48,
                      shared_expert_gate=True, norm_topk_prob=False, dense_layers=[1], qkv_bias=True),
    "qwen3-moe": dict(n_experts=4, n_experts_per_token=2, expert_d_ff=32, shared_expert_d_ff=0, norm_topk_prob=True,
                      dense_layers=None, qk_norm=True),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_moe_checkpoint_matches_transformers_each_way_of_computing_its_experts(kind, checkpoints):
    hf, directory = checkpoints[kind]
    model = load_model(pretrained(directory))
    for name, value in EXPECTED_FIELDS[kind].items():
        assert getattr(model.config, name) == value, name
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) \
        == model.config.num_params()
    ids = random_prompt(16)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()                       # (T, V)
    for strategy in STRATEGIES:
        diff = (sequence_logits(model, ids, moe_experts=strategy) - expected).abs().max().item()
        assert diff < TOL, f"{kind}, moe_experts={strategy}: max |logit diff| {diff:.2e}"


CACHES = [pytest.param("none", marks=pytest.mark.slow), "contiguous",
          pytest.param({"name": "paged", "block_size": 4}, marks=pytest.mark.slow),
          pytest.param({"name": "dynamic", "initial_tokens": 4}, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kv_cache", CACHES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_moe_checkpoint_decodes_transformers_greedy_text_with_each_strategy(kind, kv_cache, checkpoints, build,
                                                                            make_requests):
    """Two sequences in one batch (prefill of both, then decode steps of two tokens), each way."""
    hf, directory = checkpoints[kind]
    model = load_model(pretrained(directory))
    prompts = [random_prompt(12, 2), random_prompt(7, 3)]
    expected = [greedy(hf_logits(hf), p, NEW_TOKENS) for p in prompts]
    template = make_requests([1, 1], NEW_TOKENS)
    requests = [type(r)(r.request_id, tuple(p), NEW_TOKENS, r.sampling, ()) for r, p in zip(template, prompts)]
    for strategy in STRATEGIES:
        built = build({"kv_cache": kv_cache, "engine": {"moe_experts": strategy}}, model, record=False)
        seqs = sorted(built.engine.run(requests), key=lambda s: s.seq_id)
        assert [s.output_token_ids for s in seqs] == expected, f"moe_experts={strategy}"
        assert built.stats()["engine.moe_experts"] == strategy


def test_the_strategy_is_in_the_arm_label_and_a_dense_model_says_so(build, registry):
    built = build({"engine": {"moe_experts": "grouped"}}, record=False)       # the tiny dense model
    assert built.stats()["engine.moe_experts"] == "dense"
    arm = resolve_arm("grouped", {"engine": {"moe_experts": "grouped"}}, baseline_configs(registry), registry)
    assert arm.label() == "engine.moe_experts=grouped"
    with pytest.raises(ValueError, match=r"engine.moe_experts must be one of loop, grouped, got 'sorted'"):
        build({"engine": {"moe_experts": "sorted"}})


def _fuse_experts(directory: Path, layers: list[int], num_experts: int) -> None:
    """Rewrite a Qwen-style checkpoint's per-expert tensors as transformers' fused 3-D ones:
    mlp.experts.gate_up_proj (E, 2F, d), rows gate then up, and mlp.experts.down_proj (E, d, F)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    for i in layers:
        experts = f"model.layers.{i}.mlp.experts."
        gate = [tensors.pop(f"{experts}{e}.gate_proj.weight") for e in range(num_experts)]
        up = [tensors.pop(f"{experts}{e}.up_proj.weight") for e in range(num_experts)]
        down = [tensors.pop(f"{experts}{e}.down_proj.weight") for e in range(num_experts)]
        tensors[experts + "gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        tensors[experts + "down_proj"] = torch.stack(down)
    save_file(tensors, path, metadata={"format": "pt"})


def test_transformers_fused_expert_tensors_load_alike(tmp_path):
    hf = build_hf("qwen3-moe")
    directory = save_hf(hf, tmp_path / "fused", sharded=False)
    _fuse_experts(directory, [0, 1], 4)
    model = load_model(pretrained(directory))
    ids = random_prompt(16)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    assert (sequence_logits(model, ids) - expected).abs().max().item() < TOL


def _with_config(directory: Path, **changes) -> Path:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))
    return directory


@pytest.mark.parametrize("kind, changes, message", [
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be at most num_local_experts \(4\)"),
    ("mixtral", {"num_local_experts": 0}, r"num_local_experts must be a whole number >= 1, got 0"),
    ("qwen2-moe", {"mlp_only_layers": [7]}, r"mlp_only_layers must list layers 0\.\.3, got \[7\]"),
    ("qwen2-moe", {"norm_topk_prob": "yes"}, r"norm_topk_prob must be true or false, got 'yes'"),
    ("qwen3-moe", {"moe_intermediate_size": None}, r"moe_intermediate_size must be a whole number >= 1, got None"),
])
def test_a_bad_moe_field_is_refused_naming_the_file_and_key(kind, changes, message, tmp_path):
    directory = tmp_path / kind
    directory.mkdir()
    config = build_hf(kind).config.to_dict()
    (directory / "config.json").write_text(json.dumps(config))
    _with_config(directory, **changes)
    with pytest.raises(ValueError, match=message) as err:
        hf_model_fields(directory)
    assert str(directory / "config.json") in str(err.value)


def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path):
    _, directory = checkpoints["mixtral"]
    copy = tmp_path / "mixtral"
    copy.mkdir()
    for f in directory.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del index["weight_map"][name]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    from safetensors.torch import load_file, save_file
    shard = copy / json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight'"):
        load_model(pretrained(copy))


def test_active_parameters_count_the_experts_a_token_reaches():
    """By hand, Qwen2-MoE's shape at the test size: d = 64, 3 layers of which layer 1 is dense."""
    cfg = ModelConfig(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=320, qkv_bias=True,
                      tied_embeddings=False, n_experts=4, n_experts_per_token=2, expert_d_ff=32,
                      shared_expert_d_ff=48, shared_expert_gate=True, dense_layers=[1])
    d = 64
    attention = d * 16 * (4 + 2 * 2) + 4 * 16 * d + 16 * (4 + 2 * 2)     # W_qkv, W_o, the Q/K/V biases
    norms = 2 * d
    router, expert, shared = 4 * d, 3 * d * 32, 3 * d * 48 + d           # the shared expert with its gate row
    dense_mlp = 3 * d * 96
    embeddings = 2 * 320 * d + d                                         # untied table and head, the final norm
    moe_total = router + 4 * expert + shared
    moe_active = router + 2 * expert + shared
    assert cfg.num_params() == 3 * (attention + norms) + dense_mlp + 2 * moe_total + embeddings
    assert cfg.num_params(active=True) == 3 * (attention + norms) + dense_mlp + 2 * moe_active + embeddings
    assert cfg.num_params() - cfg.num_params(active=True) == 2 * 2 * expert


@pytest.mark.parametrize("fields, message", [
    (dict(n_experts=4), r"model.n_experts_per_token must be 1..model.n_experts \(4\), got 0"),
    (dict(n_experts=4, n_experts_per_token=5), r"must be 1..model.n_experts \(4\), got 5"),
    (dict(n_experts_per_token=2), r"model.n_experts_per_token set but model.n_experts is 0"),
    (dict(n_experts=4, n_experts_per_token=2, shared_expert_gate=True), r"model.shared_expert_d_ff is 0"),
    (dict(n_experts=4, n_experts_per_token=2, dense_layers=[2]), r"model.dense_layers must be layers 0..1, got \[2\]"),
    (dict(n_experts=-1), r"model.n_experts must be a whole number >= 0, got -1"),
])
def test_bad_moe_model_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


@pytest.mark.slow
def test_engine_graphs_on_a_cpu_compiles_around_each_strategy(build, make_requests):
    """torch.compile of the layers' arithmetic (engine.graphs on a CPU): the expert products stay
    eager (grouped_mm compiles in bf16 only), the tokens are the eager ones."""
    from ablate.model.presets import preset
    from ablate.model.llama import LlamaModel

    model = LlamaModel.random(preset("moe-tiny", init="random"))
    requests = make_requests([9, 5], 6)
    eager = build({"kv_cache": "contiguous"}, model, record=False).engine.run(requests)
    for strategy in STRATEGIES:
        built = build({"kv_cache": "contiguous", "engine": {"moe_experts": strategy, "graphs": True}}, model,
                      record=False)
        seqs = built.engine.run(requests)
        assert built.stats()["engine.graphs"] == "compile"
        assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in eager], strategy


def test_the_experts_strategy_is_a_technique_of_the_ablation_beside_a_variant():
    """An engine option, not a variant: the full arm holds it with variant=gqa."""
    from ablate.analysis.ablation_plan import FULL_ARM, arm_spec, parse_ablation, plan

    cfg = parse_ablation({"techniques": {"grouped_experts": {"overrides": {"engine": {"moe_experts": "grouped"}}},
                                         "gqa": {"overrides": {"variant": {"name": "gqa", "kv_heads": 1}}}}})
    full = next(p for p in plan(cfg) if p.name == FULL_ARM)
    assert arm_spec(cfg, full.techniques) == {"engine": {"moe_experts": "grouped"},
                                              "variant": {"name": "gqa", "kv_heads": 1}}


def test_the_cost_model_reads_the_experts_a_step_reaches():
    """Mixtral-8x7B's shape: 12.9B of 46.7B parameters per token, as published (with the embeddings);
    a one-token step reads 2 experts a layer, a step of 4 or more tokens all 8."""
    from ablate.analysis.analytic import CostModel
    from ablate.analysis.model_costs import model_costs
    from ablate.model.presets import preset

    cfg = preset("mixtral-8x7b", dtype="bf16")
    assert round(cfg.num_params() / 1e9, 1) == 46.7 and round(cfg.num_params(active=True) / 1e9, 1) == 12.9
    costs = model_costs({"preset": "mixtral-8x7b"}, "bf16")
    assert costs.params_active == cfg.num_params(active=True) - 32000 * 4096       # one row of the table read
    expert_bytes = 32 * 3 * 4096 * 14336 * 2                                       # one expert, every layer
    model = CostModel(cfg, keeps_kv=True)
    one, two, four, eight = (model.step([1] * n, [10] * n, n).bytes - n * 10 * model.kv_token_bytes
                             for n in (1, 2, 4, 8))
    assert two - one == 2 * expert_bytes and four - one == 6 * expert_bytes and eight == four
