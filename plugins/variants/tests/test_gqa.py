"""variant=gqa: grouped K/V heads by mean-pooling (or repeating) a model's K/V projections."""
from __future__ import annotations

import pytest
import torch

from ablate.measure.quality import sequence_logits
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate_variants.gqa import GQAConfig, mean_pool_heads, to_kv_heads

TOKENS = list(range(3, 40, 2))


@pytest.fixture(scope="module")
def mha_model() -> LlamaModel:
    """tiny with one K/V head per query head (4): MHA."""
    return LlamaModel.random(preset("tiny", n_kv_heads=4, seed=1))


def test_as_many_groups_as_heads_is_mha_exactly(mha_model):
    assert to_kv_heads(mha_model, 4) is mha_model
    same = to_kv_heads(to_kv_heads(mha_model, 4), 4)
    assert torch.equal(sequence_logits(same, TOKENS), sequence_logits(mha_model, TOKENS))


def test_gqa_equals_mha_with_kv_explicitly_repeated(mha_model):
    """MHA whose K/V heads are copies within each group of 2 == its 2-group GQA conversion."""
    repeated = to_kv_heads(to_kv_heads(mha_model, 2), 4)       # K/V heads 0,1 and 2,3 equal: still MHA
    assert repeated.config.n_kv_heads == 4
    w_k = repeated.layers[0].attn.wqkv.weight[64:128].view(4, 16, 64)
    assert torch.equal(w_k[0], w_k[1]) and torch.equal(w_k[2], w_k[3]) and not torch.equal(w_k[1], w_k[2])
    grouped = to_kv_heads(repeated, 2)
    assert grouped.config.n_kv_heads == 2
    assert grouped.layers[0].attn.wqkv.weight.shape[0] == 64 + 2 * 2 * 16
    torch.testing.assert_close(sequence_logits(grouped, TOKENS), sequence_logits(repeated, TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_mean_pool_is_the_group_mean_and_deterministic(mha_model):
    a, b = to_kv_heads(mha_model, 1), to_kv_heads(mha_model, 1)
    for la, lb, lo in zip(a.layers, b.layers, mha_model.layers):
        assert torch.equal(la.attn.wqkv.weight, lb.attn.wqkv.weight)
        k = lo.attn.wqkv.weight[64:128].view(4, 16, 64)
        assert torch.allclose(la.attn.wqkv.weight[64:80], k.mean(0), atol=1e-7)
        assert la.attn.wo is lo.attn.wo and la.mlp is lo.mlp       # the rest is shared, not copied
    rows = torch.arange(12.0).view(6, 2)                           # 3 heads of 2 rows
    assert torch.equal(mean_pool_heads(rows, 3, 1), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))


def test_conversion_leaves_the_loaded_model_alone(mha_model):
    before = sequence_logits(mha_model, TOKENS)
    to_kv_heads(mha_model, 1)
    assert mha_model.config.n_kv_heads == 4
    assert torch.equal(sequence_logits(mha_model, TOKENS), before)


def test_mqa_stores_a_third_of_smollm2_shape_kv():
    from dataclasses import replace
    smol = preset("smollm2-135m")
    assert replace(smol, n_kv_heads=1).kv_bytes_per_token() * 3 == smol.kv_bytes_per_token()


def test_bad_head_counts_are_refused(mha_model):
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide .* 4 K/V heads"):
        to_kv_heads(mha_model, 3)
    with pytest.raises(ValueError, match="kv_heads must be >= 1"):
        GQAConfig(kv_heads=0)
    with pytest.raises(ValueError, match="attention_kind=mla"):
        to_kv_heads(LlamaModel.random(preset("mla-tiny")), 1)


# the same kit call as tests/test_conformance.py::test_plugin_conforms[variant=gqa], in the default run
@pytest.mark.slow
def test_gqa_plugin_conforms(ablate_check_plugin):
    ablate_check_plugin("variant", "gqa")
