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
