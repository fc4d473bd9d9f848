"""An outside engine's arm measured once, into the same row of figures as ablate's own arms
(an ArmRun, ablate.measure.metrics): the workload's requests served, their times read by the same metrics
(TTFT, TPOT, ITL, E2E, throughputs), and its outputs as Sequences so that the experiment compares its
tokens with the baseline's like any arm's."""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import Any

from ablate.api.sequence import Request, Sequence
from ablate.engine.arm import Arm
from ablate.outside.contract import OutsideEngineError
from ablate.outside.serving import InProcess
from ablate.outside.worker import EngineWorker
from ablate.measure.metrics import ArmRun, request_table, summarise
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
    another engine takes seconds, which no round should pay), in a worker process of its own unless it
    is only a client of one (OutsideEngine.in_worker), and closed at the experiment's end."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.engines: dict[str, EngineWorker | InProcess] = {}

    def engine(self, arm: Arm, model: LlamaModel) -> EngineWorker | InProcess:
        if arm.name not in self.engines:
            cls, config = arm.outside
            try:
                self.engines[arm.name] = (EngineWorker(cls, config, model, self.max_batch) if cls.in_worker
                                          else InProcess(cls(config, model, self.max_batch)))
            except OutsideEngineError:            # its worker died: the reason says how
                raise
            except (ValueError, RuntimeError, OSError) as err:    # cannot run this model here: the arm fails, not the job
                raise OutsideEngineError(f"engine={cls.name} could not start: {err}") from err
        return self.engines[arm.name]

    def run(self, arm: Arm, model: LlamaModel, requests: Seq[Request], track_memory: bool) -> ArmRun:
        name = arm.outside[0].name
        served = self.engine(arm, model).serve(requests, track_memory)
        timeline = served.timeline
        missing = sorted({r.request_id for r in requests} - set(served.outputs)) or timeline.unfinished()
        if missing:
            raise OutsideEngineError(f"engine={name} did not finish requests {missing}")
        seqs = [finished_sequence(r, served.outputs[r.request_id]) for r in requests]
        row: dict[str, Any] = {"wall_s": served.wall_s, "kernel_compiles": 0, **summarise(timeline)}
        row["weight_bytes"] = served.weight_bytes
        # its own figure, else unknown: weights alone are no peak
        row["peak_memory_bytes"] = served.memory_bytes if served.memory_bytes is not None else math.nan
        if served.tracked_peak_bytes is not None:
            row["tracked_peak_bytes"] = served.tracked_peak_bytes
            row["peak_memory_bytes"] = row["weight_bytes"] + served.tracked_peak_bytes
        row["dtype"] = served.described.get("precision", model.config.dtype)
        row["rss_bytes"] = served.rss_bytes
        row["attention_backend"] = f"engine={name}"
        row |= {f"engine.{k}": v for k, v in served.described.items()}
        return ArmRun(row | {"status": "ok", "status_detail": ""}, request_table(timeline), seqs)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
