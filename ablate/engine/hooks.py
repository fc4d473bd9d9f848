"""What the engine tells its observers (StepHook): each arrival, each step's start and end, each
finish. The engine calls them (ablate.engine.engine); the recorder (ablate.measure.recorder), the
conformance kit's checks (ablate.testing) and benchmarks implement them."""
from __future__ import annotations

from typing import ClassVar

from ablate.api.sequence import Sequence
from ablate.api.step import Batch


class StepHook:
    """What the engine tells its observers. All methods are optional no-ops.

    times_device_work: the hook needs each step's end time to include the step's device work, so the
    engine waits for the device before reading the clock (a host sync per step); otherwise the clock
    is read at once (a step that emits tokens has waited for them anyway)."""

    times_device_work: ClassVar[bool] = False

    def on_arrival(self, seq: Sequence, at: float) -> None: ...
    def on_step_start(self, batch: Batch, at: float) -> None: ...
    def on_step_end(self, batch: Batch, emitted: dict[int, list[int]], at: float) -> None: ...
    def on_finish(self, seq: Sequence, at: float) -> None: ...
