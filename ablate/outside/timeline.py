"""What an outside engine reports: when each request arrived, was first scheduled, emitted tokens and
finished, on the perf_counter clock. It has the Recorder's shape (`requests`, `steps`), so the metrics
of ablate.measure.metrics read it unchanged; an outside engine shows no steps, so the step figures
(step time, KV utilisation, admission) are NaN for it, never made up."""
from __future__ import annotations

from ablate.api.sequence import Request
from ablate.measure.recorder import RequestRecord, StepRecord


class Timeline:
    def __init__(self) -> None:
        self.requests: dict[int, RequestRecord] = {}
        self.steps: list[StepRecord] = []      # none: an outside engine's steps are its own

    def arrive(self, request: Request, at: float) -> None:
        self.requests[request.request_id] = RequestRecord(request.request_id, at, len(request.prompt_token_ids))

    def scheduled(self, request_id: int, at: float) -> None:
        record = self.requests[request_id]
        if record.first_scheduled is None:
            record.first_scheduled = at

    def emit(self, request_id: int, at: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.requests[request_id].emissions.append((at, num_tokens))

    def finish(self, request_id: int, at: float, reason: str) -> None:
        record = self.requests[request_id]
        record.finish, record.finish_reason = at, reason

    def unfinished(self) -> list[int]:
        return sorted(i for i, r in self.requests.items() if r.finish is None)
