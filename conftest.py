"""Settings shared by every test in the repository (tests/, plugins/*/tests, kernels/tests)."""
import gc
import os

import pytest
import torch

# the tests check what is computed, not how fast, and may share the machine: no round is left out as
# contended, in this process or the CLI runs it starts (tests/test_contention.py sets the threshold
# where it tests it)
os.environ["ABLATE_MIN_CPU_SHARE"] = "0"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one CPU thread for the whole suite: the models under test are small, and on the
    2-core CI machines (often shared) two OpenMP threads spinning on an oversubscribed core make
    small matmuls many times slower than one thread does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """What lives when a test module starts (imported modules, collected tests, session fixtures) is
    moved out of the garbage collector's sight: it lives on, and a full collection, which an
    experiment runs before every timed round (ablate/experiment/arm_run.py), would otherwise walk all
    of it, a few tenths of a second each in this process. Garbage is collected first; what the tests
    create afterwards is collected as before."""
    gc.collect()
    gc.freeze()
    yield


def pytest_sessionfinish(session, exitstatus):
    gc.unfreeze()          # collectable again at exit (native bindings count what is left and complain)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (our model loaded from its saved directory, transformers' model), a random model of
    ablate.testing.hf_models built once per kind and test module."""
    from ablate.checkpoints import load_model
    from ablate.testing.hf_models import build_hf, pretrained, save_hf

    cache = {}

    def pair(kind: str):
        if kind not in cache:
            hf = build_hf(kind)
            cache[kind] = load_model(pretrained(save_hf(hf, tmp_path_factory.mktemp(kind), sharded=False))), hf
        return cache[kind]
    return pair


@pytest.fixture(scope="module")
def hf_greedy(pairs):
    """(kind, prompts, n) -> transformers' greedy continuation of n tokens of each prompt, computed once."""
    from ablate.testing.hf_models import greedy, hf_logits

    cache = {}

    def of(kind: str, prompts: list[list[int]], n: int) -> list[list[int]]:
        key = (kind, tuple(map(tuple, prompts)), n)
        if key not in cache:
            cache[key] = [greedy(hf_logits(pairs(kind)[1]), list(p), n) for p in prompts]
        return cache[key]
    return of

