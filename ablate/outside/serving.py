"""One serving of the workload by an outside engine, measured where the engine runs (its worker
process, ablate.outside.worker, or this one): the timeline's timestamps, the wall time and the tracked
memory are taken around the engine's own work, never around the messages to and from a worker, and
the engine's own figures (weights, memory, what it ran) are read right after it served."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ablate.api.sequence import Request
from ablate.outside.contract import OutsideEngine, OutsideEngineError
from ablate.outside.timeline import Timeline
from ablate.measure import device as dev
from ablate.measure.memory import TensorMemoryTracker


@dataclass
class Served:
    outputs: dict[int, list[int]]       # request id -> output tokens
    timeline: Timeline                  # on perf_counter's clock, of the process that served
    wall_s: float
    tracked_peak_bytes: int | None      # tensors allocated while serving (with track_memory)
    rss_bytes: int                      # of the process that served
    weight_bytes: int
    memory_bytes: int | None            # the engine's own figure, where it has one
    described: dict[str, str]


def measured_serve(engine: OutsideEngine, requests: Sequence[Request], track_memory: bool) -> Served:
    """engine.serve(requests) timed; an error of the engine's becomes its arm's OutsideEngineError."""
    timeline = Timeline()
    tracker = TensorMemoryTracker() if track_memory else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with tracker:
            outputs = engine.serve(requests, timeline)
    except OutsideEngineError:
        raise
    except Exception as err:           # another program's failure: recorded against its arm, the rest measured
        raise OutsideEngineError(f"engine={engine.name} failed while serving: {type(err).__name__}: {err}") from err
    wall = time.perf_counter() - start
    return Served(outputs, timeline, wall, tracker.peak_bytes if isinstance(tracker, TensorMemoryTracker) else None,
                  dev.process_rss_bytes(), engine.weight_bytes(), engine.memory_bytes(), engine.describe())


class InProcess:
    """An engine served in this process: one that is only a client of a process of its own (a server)."""

    def __init__(self, engine: OutsideEngine) -> None:
        self.engine = engine

    def serve(self, requests: Sequence[Request], track_memory: bool) -> Served:
        return measured_serve(self.engine, requests, track_memory)

    def close(self) -> None:
        self.engine.close()
