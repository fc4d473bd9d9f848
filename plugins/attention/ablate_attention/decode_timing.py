"""attention=paged backend=auto: which kernel runs a decode step, chosen by timing on this machine.

The native CPU kernel beats the PyTorch block-table gather on one CPU and loses to it on another
(an AMX Xeon served 64 requests 1.55x faster through gather + SDPA; a Zen 4 the other way round), so
a constant cannot choose. As for the CPU matrix products (ablate/model/product_paths.py), the choice
is made per kind of decode step, keyed by what changes the winner (`decode_key`): device type,
dtype, KV heads, head dim, query heads per KV head, block size, a class of batch size (1, 2-16, 17+),
a class of context length (longest sequence up to 512, 513-2048, more) and torch's threads. The
first decode step of a key runs every candidate (`time_decode`) on that step's own inputs: one
warm-up call (a Triton kernel compiles there, out of the timing), then TIMED_RUNS timed calls; the
fastest median wins and its output is the step's. Later steps of the key run the winner untimed.
The choices are kept for the process (`decode_choices()` lists them), like the product paths'.

Candidates: on the CPU the native kernel (where it takes the shapes) and the gather; on a GPU the
Triton kernel and the gather. A GPU step is timed with CUDA events, synchronizing only inside the
timing (once per key); a step that cannot be timed (one being captured into a CUDA graph, which
allows no sync) runs the default kernel (Triton, native) unless its key was chosen already: the
warm-up run engine.graphs makes before each capture times it. A captured graph keeps the kernel of
the step it was captured on, whatever the contexts of the steps that replay it.

Each timing is counted once, by ablate.api.tuning (`timings()` reads it), which adds it to runs.csv's
path_timings and lists the choice in environment.json; per arm, the plugin's `decode_timings` stat.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ablate.api import tuning

TIMED_RUNS = 3                 # timed calls per candidate after its warm-up: the median decides
BATCH_CLASSES = (1, 16)        # upper bounds: 1 sequence, 2-16, 17+
CONTEXT_CLASSES = (512, 2048)  # upper bounds of the longest context: up to 512, 513-2048, 2049+


def _class_names(bounds: tuple[int, ...]) -> tuple[str, ...]:
    names, low = [], 1
    for high in bounds:
        names.append(str(high) if low == high else f"{low}-{high}")
        low = high + 1
    return (*names, f"{low}+")


BATCH_CLASS_NAMES = _class_names(BATCH_CLASSES)
CONTEXT_CLASS_NAMES = _class_names(CONTEXT_CLASSES)


@dataclass(frozen=True)
class DecodeKey:
    """What changes which kernel is fastest for a decode step."""
    device: str
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    group: int                 # query heads per KV head
    block_size: int
    batch_class: int           # an index into BATCH_CLASS_NAMES
    context_class: int         # an index into CONTEXT_CLASS_NAMES
    threads: int

    def classes(self) -> str:
        """'2-16 seqs, context 1-512': the part of the key a run's steps move through."""
        return f"batch {BATCH_CLASS_NAMES[self.batch_class]}, context {CONTEXT_CLASS_NAMES[self.context_class]}"

    def __str__(self) -> str:
        return (f"{self.device} {str(self.dtype).removeprefix('torch.')} {self.kv_heads} kv heads x {self.head_dim}, "
                f"{self.group} q/kv, block {self.block_size}, {self.classes()}, {self.threads} threads")


@dataclass(frozen=True)
class DecodeChoice:
    kernel: str                       # the winner: native, triton or torch
    seconds: dict[str, float]         # each candidate's median time per call

    def label(self, classes: str = "") -> str:
        """'native(timed: native 1.2 ms, torch 1.9 ms)', after `classes` ("batch 1, context 1-512") if given."""
        times = ", ".join(f"{name} {_ms(s)}" for name, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        return f"{self.kernel}({classes + ', ' if classes else ''}timed: {times})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


_choices: dict[DecodeKey, DecodeChoice] = {}


def decode_key(q: torch.Tensor, k_cache: torch.Tensor, kv_lens: list[int]) -> DecodeKey:
    """The key of a decode step: q (B, H, D), a cache (num_blocks, block_size, H_kv, D), the step's
    host-side lengths (no device read). torch's threads count on the CPU only."""
    kv_heads = k_cache.shape[2]
    device = q.device.type
    return DecodeKey(device, q.dtype, kv_heads, k_cache.shape[-1], q.shape[1] // kv_heads, k_cache.shape[1],
                     bisect.bisect_left(BATCH_CLASSES, len(kv_lens)),
                     bisect.bisect_left(CONTEXT_CLASSES, max(kv_lens, default=0)),
                     torch.get_num_threads() if device == "cpu" else 0)


def choice_for(key: DecodeKey) -> DecodeChoice | None:
    """The kernel chosen for steps of `key`, or None while none is."""
    return _choices.get(key)


def can_time(device: torch.device) -> bool:
    """Whether a step may be timed now: not while it is captured into a CUDA graph (no sync allowed)
    nor traced by torch.compile."""
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def measure(name: str, fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """Candidate `name`'s median seconds per call of `fn` (after one warm-up call) and its last output.
    On a GPU, CUDA events around each call and a sync after it: this runs once per key."""
    out = fn()                                 # warm-up: a Triton kernel compiles here, the caches fill
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(TIMED_RUNS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def time_decode(key: DecodeKey, candidates: dict[str, Callable[[], torch.Tensor]],
                device: torch.device) -> tuple[DecodeChoice, torch.Tensor]:
    """Time every candidate on the step they all compute; keep the fastest for `key`. Returns the
    choice and the winner's output (the step's result)."""
    seconds, outputs = {}, {}
    for name, fn in candidates.items():
        seconds[name], outputs[name] = measure(name, fn, device)
    choice = DecodeChoice(min(seconds, key=seconds.get), seconds)
    _choices[key] = choice
    tuning.timed()                                    # the core flags a run holding it, and lists the choice
    tuning.chose("attention=paged decode", str(key), choice.label())
    return choice, outputs[choice.kernel]


def decode_choices() -> dict[str, str]:
    """The decode kernels chosen in this process, for the results: key -> 'native(timed: ...)'."""
    return {str(key): choice.label() for key, choice in sorted(_choices.items(), key=lambda kv: str(kv[0]))}


def timings() -> int:
    """Timings run so far in this process, plugins' alike: ablate.api.tuning keeps the one count."""
    return tuning.timings()


def reset() -> dict[DecodeKey, DecodeChoice]:
    """Forget every choice (the next decode steps are timed again); returns them, for restore(). The
    count of timings runs on."""
    saved = dict(_choices)
    _choices.clear()
    return saved


def restore(saved: dict[DecodeKey, DecodeChoice]) -> None:
    _choices.clear()
    _choices.update(saved)
