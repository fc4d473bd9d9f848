"""attention=flash: the Triton kernels give the naive baseline's greedy tokens (Triton's interpreter
on a CPU), and without Triton the plugin falls back to SDPA with a warning and records it.

Triton reads TRITON_INTERPRET once, when it is first imported, and other test modules of the same
pytest process import it first (the kernels' tests switch the interpreter on at collection), so the
engine-level checks run in a fresh interpreter (flash_check.py) with the variable set, or removed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ablate.api.context import BuildContext, EngineConfig, KVSpec
from ablate.api.kv import PackedKV
from ablate_attention.flash import FlashAttention, FlashConfig, unsupported_shape

CHECK = Path(__file__).with_name("flash_check.py")


def run_check(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """flash_check.py's result with the kernels in Triton's interpreter (minutes: run once per module)."""
    return run_check(interpret=True)


@pytest.mark.slow
def test_flash_kernels_in_the_interpreter_give_the_naive_greedy_tokens(interpreted):
    result = interpreted
    assert result["triton_available"]
    for name, arm in result["arms"].items():
        assert arm["same_tokens"], name
        assert arm["backend"] == "flash-triton-interpreted", (name, arm["backend"])   # labelled: never a timing
    assert result["arms"]["contiguous-chunked"]["kinds"] == ["decode", "prefill"]
    assert result["arms"]["mla-contiguous"]["kinds"] == ["decode", "prefill"]
    assert result["arms"]["paged"]["kinds"] == ["decode", "prefill"]
    assert result["warnings"] == []


@pytest.mark.slow
def test_flash_decode_steps_replay_from_graphs_over_rows_and_blocks(interpreted):
    """graph_safe holds for every view flash decodes: replays (emulated: the captured step's lists,
    live tensors) give the eager tokens and no arm falls back to eager; a decode path that read the
    step's lists (the paged gather sized by max_kv_len) diverged here and turned graphs off."""
    assert set(interpreted["graphs"]) == {"contiguous-chunked", "paged"}
    for name, arm in interpreted["graphs"].items():
        assert arm["disabled"] is None, (name, arm["disabled"])
        assert arm["replays"] >= 1 and arm["same_tokens"], (name, arm)


@pytest.mark.slow
def test_without_triton_on_a_cpu_flash_falls_back_to_sdpa_with_a_warning_and_records_it():
    result = run_check(interpret=False)
    assert not result["triton_available"]
    for name, arm in result["arms"].items():
        assert arm["same_tokens"], name
        assert arm["backend"].startswith("sdpa-fallback(no Triton on cpu: sdpa("), (name, arm["backend"])
    assert len(result["warnings"]) == 1          # once per reason per process, not per call or per arm
    assert "TRITON_INTERPRET=1" in result["warnings"][0] and "scaled_dot_product_attention" in result["warnings"][0]


def test_shapes_the_kernels_do_not_take_are_named():
    q = torch.zeros(4, 2, 24)
    assert unsupported_shape(q, q, q) == "head_dim 24 is not a power of two in 16..256"
    q = torch.zeros(4, 2, 32)
    assert "K/V widths 32/16" in unsupported_shape(q, q, q[..., :16])
    assert unsupported_shape(q, q, q) is None


def test_an_unsupported_head_dim_falls_back_per_call_and_is_recorded(monkeypatch):
    engine = EngineConfig(max_num_seqs=1)
    plugin = FlashAttention(FlashConfig(), BuildContext(None, KVSpec(1, 2, 24, 24, torch.float32, torch.device("cpu"),
                                                                     1, 8), engine))
    monkeypatch.setattr(plugin, "no_triton_reason", None)      # as if Triton could run here
    from ablate.api.sequence import Request, Sequence
    from ablate.api.step import StepInputs
    n = 5
    step = StepInputs(seqs=[Sequence(Request(0, (1,) * n, 1))], input_ids=torch.ones(n, dtype=torch.long),
                      positions=torch.arange(n), query_lens=[n], context_lens=[n], query_starts=[0, n],
                      logits_indices=torch.tensor([n - 1]), query_starts_t=torch.tensor([0, n], dtype=torch.int32))
    q, k = torch.randn(n, 2, 24), torch.randn(n, 2, 24)
    with pytest.warns(UserWarning, match="head_dim 24 is not a power of two"):
        out = plugin(q, PackedKV(k, k), step)
    assert out.shape == (n, 2, 24)
    assert plugin.backend.startswith("sdpa-fallback(head_dim 24 is not a power of two in 16..256: sdpa(")
    assert plugin.stats() == {"backends": plugin.backend}


def test_flash_plugin_conforms(ablate_check_plugin, monkeypatch):
    """The conformance kit, on the SDPA fallback: in this process Triton may run in its interpreter
    (other test modules switch it on), where the kit's workload takes minutes; the kernels' greedy
    tokens are checked above, in a fresh process."""
    import types

    import ablate_attention.flash as flash
    monkeypatch.setattr(flash, "kernels_module", lambda: types.SimpleNamespace(triton_available=lambda device: False,
                                                                                backend_label=lambda device: "unavailable"))
    ablate_check_plugin("attention", "flash")
