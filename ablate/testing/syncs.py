"""Host syncs on the step path, counted on any device.

On a GPU the host runs ahead of the device: it queues a step's kernels and prepares the next step
while they run. A call that needs a value computed on the device (`.item()`, `.tolist()`,
`bool(tensor)`, `nonzero()`, `repeat_interleave` without its output size, `.cpu()`...) makes the host
wait for the queue to drain, so each one on the step path costs a device round trip, and one inside
a layer costs one per layer. A CPU has nothing to wait for, but the calls are the same: this counts
them (a TorchFunctionMode) with the clock's device synchronisations, per step and per layer, so a
test on a CPU keeps the GPU path free of them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

import ablate.api.clock as clock
from ablate.api.sequence import Request
from ablate.api.step import Batch
from ablate.engine.hooks import StepHook

# calls that return host values computed on the device, or whose output size depends on them
# (Tensor.numpy is not one: on a GPU tensor it raises, and the CPU's numpy product path calls it)
SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
           torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
           torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
           torch.equal, torch.allclose}
SIZED_BY_VALUES = {torch.repeat_interleave, torch.Tensor.repeat_interleave}   # unless output_size is given
# tensors made from host data: each a host-to-device copy on a GPU. One given a device object is made in
# pageable memory and copied by a blocking call: a sync (api.device_tensor stages it in pinned memory)
FROM_HOST = {torch.tensor, torch.as_tensor}

# the sampled tokens, and the step's end clock when a hook times the device work (the recorder) or a
# decoding plugin's clock timing its own phases (speculative: the verify pass)
MAX_SYNCS_PER_DECODE_STEP = 2
# the runner's packed inputs (one copy), the cache's plan (write index, rows or block tables), one spare;
# a drafter that runs a model makes as many again per draft token (MAX_HOST_COPIES_PER_DRAFT)
MAX_HOST_COPIES_PER_DECODE_STEP = 6
MAX_HOST_COPIES_PER_DRAFT = 4
DRAFT_K = 3
# every built-in plugin in at least one arm; name -> (arm spec, extra syncs a decode step may make):
# a drafter that runs a model draws each draft token from the last one's logits on the host (the
# ModelSession API takes token lists), one sync per draft token
BUILT_IN_ARMS: dict[str, tuple[dict, int]] = {
    "recompute": ({}, 0),
    "contiguous": ({"kv_cache": "contiguous"}, 0),
    "dynamic": ({"kv_cache": {"name": "dynamic", "initial_tokens": 4}}, 0),
    "paged": ({"kv_cache": {"name": "paged", "block_size": 4}}, 0),
    "paged+paged-attention": ({"kv_cache": {"name": "paged", "block_size": 4}, "attention": "paged"}, 0),
    "streaming": ({"kv_cache": {"name": "streaming", "window": 8, "num_sinks": 2}}, 0),
    "sdpa": ({"kv_cache": "contiguous", "attention": "sdpa"}, 0),
    "flash": ({"kv_cache": "contiguous", "attention": "flash"}, 0),
    "continuous": ({"kv_cache": {"name": "paged", "block_size": 4}, "scheduler": "continuous"}, 0),
    "speculative-ngram": ({"kv_cache": "contiguous",
                           "decoding": {"name": "speculative", "drafter": "ngram", "k": DRAFT_K}}, 0),
    "speculative-early-exit": ({"kv_cache": "contiguous",
                                "decoding": {"name": "speculative", "drafter": "early_exit", "k": DRAFT_K}}, DRAFT_K),
    "speculative-layer-skip": ({"kv_cache": "contiguous",
                                "decoding": {"name": "speculative", "drafter": "layer_skip", "k": DRAFT_K}}, DRAFT_K),
    "gqa": ({"kv_cache": "contiguous", "variant": {"name": "gqa", "kv_heads": 1}}, 0),
    "mla": ({"kv_cache": "contiguous", "variant": {"name": "mla", "rank": 16}}, 0),
    "graphs": ({"kv_cache": "contiguous", "attention": "sdpa", "engine": {"graphs": True}}, 0),
}


@dataclass
class StepSyncs:
    decode: bool                                       # every sequence of the step past its prompt
    total: int = 0                                     # syncs from this step's start to the next's
    per_layer: Counter = field(default_factory=Counter)   # layer -> syncs inside it
    calls: Counter = field(default_factory=Counter)       # which calls
    host_copies: int = 0                                  # tensors made from host data (FROM_HOST)
    host_copies_per_layer: Counter = field(default_factory=Counter)


class SyncCounter(TorchFunctionMode, StepHook):
    """Counts host syncs while an engine runs: `with SyncCounter(built) as counter: engine.run(...)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.steps: list[StepSyncs] = []
        self.layer: int | None = None
        self._hooks = []
        for i, layer in enumerate(model.layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: self._enter(i)))
            self._hooks.append(layer.register_forward_hook(lambda *_: self._enter(None)))

    def _enter(self, layer: int | None) -> None:
        self.layer = layer

    def on_step_start(self, batch: Batch, at: float) -> None:
        decode = all(s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs)
        self.steps.append(StepSyncs(decode))

    def count(self, name: str) -> None:
        if self.steps:           # before the first step: admission, not the step path
            step = self.steps[-1]
            step.total += 1
            step.calls[name] += 1
            if self.layer is not None:
                step.per_layer[self.layer] += 1

    def copied(self) -> None:
        if self.steps:
            step = self.steps[-1]
            step.host_copies += 1
            if self.layer is not None:
                step.host_copies_per_layer[self.layer] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (func in SIZED_BY_VALUES and "output_size" not in kwargs
                               and any(isinstance(a, torch.Tensor) for a in args[1:2])):
            self.count(getattr(func, "__name__", str(func)))
        elif func in FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            self.copied()
            if isinstance(kwargs.get("device"), torch.device) and not kwargs.get("pin_memory"):
                self.count("pageable host-to-device copy")
        return func(*args, **kwargs)

    def __enter__(self):
        self._synchronize, clock.synchronize = clock.synchronize, self._counted_synchronize
        return super().__enter__()

    def __exit__(self, *exc):
        clock.synchronize = self._synchronize
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _counted_synchronize(self, device: torch.device) -> None:
        self.count("synchronize")
        self._synchronize(device)


def count_syncs(built, requests: list[Request]) -> list[StepSyncs]:
    """Run `requests` through a built arm, counting host syncs per step."""
    counter = SyncCounter(built.engine.runner.model)
    built.engine.hooks.append(counter)
    try:
        with counter:
            built.engine.run(requests)
    finally:
        built.engine.hooks.remove(counter)
    return counter.steps


def summary(steps: list[StepSyncs]) -> dict[str, float]:
    """The most syncs of any decode step, and of any layer but the first of a decode step (a sync
    in every layer; the first may compute what the step's other layers reuse); the same for the
    tensors made from host data (host-to-device copies on a GPU)."""
    decode = [s for s in steps if s.decode]
    return {"decode_steps": len(decode),
            "max_per_step": max((s.total for s in decode), default=0),
            "max_per_layer": max((n for s in decode for layer, n in s.per_layer.items() if layer > 0), default=0),
            "calls": sum((s.calls for s in decode), Counter()),
            "max_host_copies_per_step": max((s.host_copies for s in decode), default=0),
            "max_host_copies_per_layer": max((n for s in decode for layer, n in s.host_copies_per_layer.items()
                                              if layer > 0), default=0)}
