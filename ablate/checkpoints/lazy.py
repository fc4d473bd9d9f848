"""A checkpoint's tensors by name, each read only when asked for and never kept.

A model is built from it one tensor at a time (LlamaModel.from_hf_state_dict copies each into its
place on the device, cast to the model's dtype, and drops it), so host memory holds a few tensors,
not the checkpoint: llama-3-8b loads without 16-32 GB of host memory. With workers > 1 the next
`workers` tensors of `order` are read ahead in threads (a GGUF's dequantisation: numpy and torch
release the GIL in their element-wise work), which bounds what is held to about `workers` tensors.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class LazyTensors(Mapping[str, torch.Tensor]):
    """name -> tensor, `read(name)` at each lookup; `order`: every name, in the order a model build
    takes them (what is read ahead)."""

    def __init__(self, read: Callable[[str], torch.Tensor], order: list[str], workers: int = 1) -> None:
        self._read = read
        self._order = list(order)
        self._position = {name: i for i, name in enumerate(self._order)}
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self._ahead: dict[str, Future[torch.Tensor]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._position:
            raise KeyError(name)
        if self._pool is None:
            return self._read(name)
        future = self._ahead.pop(name, None) or self._pool.submit(self._read, name)
        at = self._position[name]
        for following in self._order[at + 1:at + 1 + self._workers]:
            if following not in self._ahead:
                self._ahead[following] = self._pool.submit(self._read, following)
        return future.result()

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def close(self) -> None:
        """Drop what was read ahead and stop the threads (a build that failed midway leaves some)."""
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None           # later lookups read in this thread
