"""An outside engine's arm measured once, into the same row of figures as ablate's own arms
(ablate.experiment.arm_run): the workload's requests served, their times read by the same metrics
(TTFT, TPOT, ITL, E2E, throughputs), and its outputs as Sequences so that the experiment compares its
tokens with the baseline's like any arm's."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence as Seq
from typing import Any


from ablate.api.sequence import Request, Sequence
from ablate.engine.arm import Arm
from ablate.engines.contract import OutsideEngine, OutsideEngineError
from ablate.engines.timeline import Timeline
from ablate.experiment.arm_run import ArmRun
from ablate.measure import device as dev
from ablate.measure.memory import TensorMemoryTracker
from ablate.measure.metrics import request_table, summarise
from ablate.model.llama import LlamaModel


def finished_sequence(request: Request, output: list[int]) -> Sequence:
    """The Sequence of a request an outside engine served: its prompt and `output`, finished."""
    seq = Sequence(request)
    seq.start()
    seq.advance(len(request.prompt_token_ids), output)
    if not seq.is_finished:
        raise OutsideEngineError(f"request {request.request_id}: {len(output)} output tokens, neither "
                                 f"max_new_tokens ({request.max_new_tokens}) nor ending at a stop token")
    return seq


class OutsideRuns:
    """The outside engines of one experiment: each built once, on its first run (loading weights into
    another engine takes seconds, which no round should pay), and closed at the experiment's end."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.engines: dict[str, OutsideEngine] = {}

    def engine(self, arm: Arm, model: LlamaModel) -> OutsideEngine:
        if arm.name not in self.engines:
            cls, options = arm.outside
            try:
                self.engines[arm.name] = cls(options, model, self.max_batch)
            except (ValueError, RuntimeError, OSError) as err:    # cannot run this model here: the arm fails, not the job
                raise OutsideEngineError(f"engine={cls.name} could not start: {err}") from err
        return self.engines[arm.name]

    def run(self, arm: Arm, model: LlamaModel, requests: Seq[Request], track_memory: bool) -> ArmRun:
        engine = self.engine(arm, model)
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
        missing = sorted({r.request_id for r in requests} - set(outputs)) or timeline.unfinished()
        if missing:
            raise OutsideEngineError(f"engine={engine.name} did not finish requests {missing}")
        seqs = [finished_sequence(r, outputs[r.request_id]) for r in requests]
        row: dict[str, Any] = {"wall_s": wall, "kernel_compiles": 0, **summarise(timeline)}
        row["weight_bytes"] = engine.weight_bytes()
        own = engine.memory_bytes()       # its own figure, else unknown: weights alone are no peak
        row["peak_memory_bytes"] = own if own is not None else math.nan
        if isinstance(tracker, TensorMemoryTracker):
            row["tracked_peak_bytes"] = tracker.peak_bytes
            row["peak_memory_bytes"] = row["weight_bytes"] + tracker.peak_bytes
        described = engine.describe()
        row["dtype"] = described.get("precision", model.config.dtype)
        row["rss_bytes"] = dev.process_rss_bytes()
        row["attention_backend"] = f"engine={engine.name}"
        row |= {f"engine.{k}": v for k, v in described.items()}
        return ArmRun(row | {"status": "ok", "status_detail": ""}, request_table(timeline), seqs)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
