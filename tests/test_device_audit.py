"""Device audit: every tensor factory in ablate/ and plugins/ says which device its tensor goes to.

A factory call without `device=` (torch.zeros(n), torch.tensor(ids), ...) makes its tensor on the
default device, the CPU: on a GPU it then meets CUDA tensors and the step crashes, or silently
syncs. Two checks:
- static: an AST scan of every module (tests excluded) for torch.<factory>(...) without a `device`
  keyword, outside NO_DEVICE_OK below;
- dynamic: a TorchFunctionMode records every factory call made while a tiny engine runs a few
  arms: a call from this repository without `device=` outside NO_DEVICE_OK fails, and so does a
  tensor made off the model's device outside HOST_SIDE (that part bites on a GPU, where the test
  also runs the model on CUDA).
"""
from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("ablate", "plugins")
FACTORIES = ("tensor", "arange", "zeros", "ones", "empty", "full", "randn", "rand", "randint", "randperm",
             "as_tensor", "linspace", "eye")          # *_like and Tensor.new_* take their input's device

# (file, function as Python's co_qualname spells it) -> why a factory there may omit device=
NO_DEVICE_OK = {
    ("ablate/model/llama.py", "RMSNorm.__init__"):
        "module parameter: made on the default device so that `with torch.device('meta')` builds work; "
        "finalize() moves the model to its device",
    ("ablate/model/llama.py", "LlamaModel.__init__"):
        "module parameter (the embedding), as RMSNorm.__init__",
    ("ablate/model/moe.py", "MixtureOfExperts.__init__"):
        "module parameters (every expert's weights in two 3-D tensors), as RMSNorm.__init__",
    ("ablate/testing/hf_models.py", "randomise"):
        "host-side by design: a transformers model on the CPU, drawn from one seeded CPU generator",
    ("ablate/model/llama.py", "LlamaModel.random"):
        "host-side by design, on the CPU only: each weight is drawn in fp32 from one seeded CPU generator, then "
        "cast into its parameter (the same weights in every dtype); on an accelerator it is drawn in place",
    ("ablate/api/step.py", "device_tensor"):
        "host staging in pinned memory (pin_memory=True is CPU-only), copied to the device on the same line",
}

# step-path functions that make tensors on the CPU on purpose (the device check, which bites on a GPU)
HOST_SIDE = {
    ("plugins/decoding/ablate_decoding/acceptance.py", "accept_drafts"):
        "speculative acceptance runs on the CPU by design: k + 1 rows, and u drawn from the request's seeded "
        "CPU generator",
    ("ablate/api/step.py", "device_tensor"):
        "pinned host staging, copied to the device on the same line",
}


def missing_device_calls() -> list[tuple[str, int, str, str]]:
    """(file, line, function, call) of every torch.<factory>(...) without a `device` keyword."""
    found = []
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            if "tests" in rel.parts:
                continue
            found += _scan(ast.parse(path.read_text(), str(rel)), rel.as_posix())
    return found


def _scan(tree: ast.AST, file: str) -> list[tuple[str, int, str, str]]:
    found = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                    and f.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
                found.append((file, node.lineno, ".".join(scope) or "<module>", ast.unparse(node)))
        if isinstance(node, ast.ClassDef):
            scope = [*scope, node.name]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            # co_qualname's spelling: outer.<locals>.inner
            name = node.name if not isinstance(node, ast.Lambda) else "<lambda>"
            scope = [*scope, name, "<locals>"]
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return [(file, line, scope.removesuffix(".<locals>"), call) for file, line, scope, call in found]


def test_every_tensor_factory_names_its_device():
    calls = missing_device_calls()
    unlisted = [f"{file}:{line} in {func}: {call}" for file, line, func, call in calls
                if (file, func) not in NO_DEVICE_OK]
    assert not unlisted, ("tensor factory calls without device= (on a GPU the tensor lands on the CPU next to "
                          "CUDA tensors); pass device=<the tensor it meets>.device, or device='cpu' for a "
                          "host-side tensor:\n  " + "\n  ".join(unlisted))
    stale = sorted(set(NO_DEVICE_OK) - {(file, func) for file, _, func, _ in calls})
    assert not stale, f"NO_DEVICE_OK entries that match no call any more (remove them): {stale}"


def test_the_scan_finds_a_call_without_device():
    tree = ast.parse("class A:\n def f(self):\n  def g():\n   return torch.zeros(3)\n  return torch.ones(2, device=d)\n")
    assert _scan(tree, "x.py") == [("x.py", 4, "A.f.<locals>.g", "torch.zeros(3)")]


class FactoryRecorder(TorchFunctionMode):
    """Records (file, line, function, factory, explicit device?, tensor's device) of every factory
    call made from this repository's code while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, str, str, bool, torch.device]] = []
        self._factories = {getattr(torch, name) for name in FACTORIES}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._factories:
            caller = sys._getframe(1)          # the torch.<factory>(...) call site itself
            path = Path(caller.f_code.co_filename).resolve()
            if path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in SCANNED:
                self.calls.append((path.relative_to(REPO).as_posix(), caller.f_lineno, caller.f_code.co_qualname,
                                   func.__name__, "device" in kwargs, out.device))
        return out


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
ARMS = {   # a few arms whose step paths differ: caches, attentions, chunked prefill, drafts, sampling, MLA
    "baseline": ("tiny", {}),
    "contiguous-sdpa": ("tiny", {"kv_cache": "contiguous", "attention": "sdpa"}),
    "dynamic-flash": ("tiny", {"kv_cache": "dynamic", "attention": "flash"}),
    "paged-chunked": ("tiny", {"kv_cache": {"name": "paged", "block_size": 4}, "attention": "paged",
                               "scheduler": {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 2}}),
    "streaming": ("tiny", {"kv_cache": "streaming"}),
    "speculative": ("tiny", {"kv_cache": "contiguous", "decoding": "speculative"}),
    "mla-paged": ("mla-tiny", {"kv_cache": {"name": "paged", "block_size": 4}, "attention": "paged"}),
}


@pytest.mark.parametrize("arm_name", list(ARMS))
@pytest.mark.parametrize("device", DEVICES)
def test_the_step_path_makes_every_tensor_on_the_model_device(arm_name, device, registry):
    model_name, spec = ARMS[arm_name]
    model = LlamaModel.random(preset(model_name), device)
    requests = [Request(0, (3, 1, 4, 1, 5), 4), Request(1, (9, 2, 6), 5, SamplingParams(0.8, seed=3))]
    arm = resolve_arm(arm_name, spec, baseline_configs(registry), registry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "no Triton on cpu" fallbacks are tested elsewhere
        built = build_arm(arm, model, EngineConfig(max_num_seqs=2), 16, registry)
        with FactoryRecorder() as recorder:
            built.engine.run(requests)
    assert recorder.calls, "the recorder saw no factory call: TorchFunctionMode no longer sees factories?"
    want = next(model.parameters()).device
    no_device = sorted({f"{f}:{line} in {func}: torch.{name}(...)" for f, line, func, name, explicit, _ in recorder.calls
                        if not explicit and (f, func) not in NO_DEVICE_OK})
    assert not no_device, ("tensor factories on the step path without device= (on a GPU their tensors land on "
                           "the CPU):\n  " + "\n  ".join(no_device))
    off_device = sorted({f"{f}:{line} in {func}: torch.{name}(...) on {got}, the model is on {want}"
                         for f, line, func, name, _, got in recorder.calls if got != want and (f, func) not in HOST_SIDE})
    assert not off_device, "tensors made off the model's device on the step path:\n  " + "\n  ".join(off_device)


@pytest.mark.parametrize("device", DEVICES)
def test_perplexity_scores_on_the_model_device(device, tiny_model):
    from ablate.measure.quality import token_nlls

    ids = list(range(3, 90, 2))
    nll = token_nlls(LlamaModel.random(preset("tiny"), device), ids, window=24, stride=12)
    assert nll.device.type == "cpu" and nll.shape == (len(ids) - 1,)
    torch.testing.assert_close(nll, token_nlls(tiny_model, ids, window=24, stride=12), rtol=1e-4, atol=1e-4)
