"""ablate.measure.memory: the CPU tensor tracker sees what a block allocates, and attention's n x n scores."""
from __future__ import annotations

import torch

from ablate.measure.memory import TensorMemoryTracker, peak_memory_of


def test_tracker_sees_a_known_allocation_and_its_free():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)            # 4000 bytes
        view = a.view(10, 100)                                 # a view: no new storage
        a.add_(1.0)                                            # in place: no new storage
        b = torch.zeros(250, dtype=torch.float64)              # 2000 bytes, both live: 6000
        del a, view
        c = torch.ones(100, dtype=torch.int8)                  # 100 bytes after 4000 were freed
    assert tracker.peak_bytes == 6000
    assert tracker.live_bytes == 2100
    assert tracker.num_allocations == 3
    del b, c


def test_tensors_made_before_the_block_are_not_counted():
    x = torch.randn(256, 256)
    _, peak = peak_memory_of(lambda: x.mul_(2.0).sum(), torch.device("cpu"))
    assert peak.method == "tensor-tracker" and peak.bytes == 4     # only the scalar sum


def test_materialised_scores_are_seen():
    """softmax(q k^T) over n = 256 keys and 4 heads: at least one fp32 (4, 256, 256) matrix alive."""
    q = k = v = torch.randn(4, 256, 32)
    with torch.inference_mode():
        _, peak = peak_memory_of(lambda: torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v, torch.device("cpu"))
    assert peak.bytes >= 2 * 4 * 256 * 256 * 4       # the scores and their softmax, both alive at once
