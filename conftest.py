"""Settings shared by every test in the repository (tests/, plugins/*/tests, kernels/tests)."""
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one CPU thread for the whole suite: the models under test are small, and on the
    2-core CI machines (often shared) two OpenMP threads spinning on an oversubscribed core make
    small matmuls many times slower than one thread does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
