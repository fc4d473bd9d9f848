"""The driver of engines whose API serves a fixed batch to its end (transformers' generate(), llama.cpp's
one-sequence generate): arrivals are waited for in real time, the requests that have arrived are taken in
arrival order, up to the batch limit, and the batch runs to its end before the next starts. That is
static batching, the only batching such an API offers; a request that arrives meanwhile queues, and its
TTFT counts the wait, exactly as for ablate's static scheduler.

The engine hands each request's tokens to `emit` as they appear; the driver keeps them up to the
request's max_new_tokens or its first stop token and timestamps them, so every engine's outputs and
times are cut by the same rule as ablate's (Sequence.advance)."""
from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence

from ablate.api.sequence import Request
from ablate.outside.contract import OutsideEngine, OutsideEngineError
from ablate.outside.timeline import Timeline
from ablate.workload.arrivals import ArrivalQueue


class Emitter:
    """Collects the tokens of one batch's requests as the engine emits them."""

    def __init__(self, batch: Sequence[Request], timeline: Timeline) -> None:
        self.requests = {r.request_id: r for r in batch}
        self.outputs: dict[int, list[int]] = {r.request_id: [] for r in batch}
        self.reasons: dict[int, str] = {}
        self.timeline = timeline

    def __call__(self, request_id: int, tokens: Sequence[int]) -> None:
        """`tokens` just produced for the request (one, or several from one pass of a speculative
        engine): those within its length and before its stop token are kept, and timed now."""
        at = time.perf_counter()
        if request_id in self.reasons:
            return
        request, out = self.requests[request_id], self.outputs[request_id]
        kept = 0
        for token in tokens:
            out.append(int(token))
            kept += 1
            if int(token) in request.stop_token_ids:
                self.reasons[request_id] = "stop"
                break
            if len(out) >= request.max_new_tokens:
                self.reasons[request_id] = "length"
                break
        self.timeline.emit(request_id, at, kept)
        if request_id in self.reasons:
            self.timeline.finish(request_id, at, self.reasons[request_id])

    def done(self, request_id: int) -> bool:
        return request_id in self.reasons

    @property
    def all_done(self) -> bool:
        return len(self.reasons) == len(self.requests)


class OneBatchAtATime(OutsideEngine):
    def batch_limit(self) -> int:
        """The most requests one generate() call takes (an engine option may lower it to 1)."""
        return self.max_batch

    @abstractmethod
    def generate(self, batch: list[Request], emit: Emitter) -> None:
        """Serve `batch` to its end, calling emit(request_id, tokens) as each request's tokens appear,
        until emit.done(request_id) for every request."""

    def serve(self, requests: Sequence[Request], timeline: Timeline) -> dict[int, list[int]]:
        queue = ArrivalQueue(requests)
        outputs: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        waiting: list[tuple[float, Request]] = []          # (its arrival, seconds after t0; request)
        while waiting or not queue.empty:
            waiting += queue.due(time.perf_counter() - t0)
            if not waiting:
                next_time = queue.next_time()
                if next_time is None:
                    raise OutsideEngineError(f"engine={self.name}: requests wait on requests that never finish")
                time.sleep(max(0.0, next_time - (time.perf_counter() - t0)))
                continue
            batch, waiting = waiting[:self.batch_limit()], waiting[self.batch_limit():]
            start = time.perf_counter()
            for arrival, request in batch:
                timeline.arrive(request, t0 + arrival)
                timeline.scheduled(request.request_id, start)
            emit = Emitter([r for _, r in batch], timeline)
            self.generate([r for _, r in batch], emit)
            if not emit.all_done:
                short = sorted(set(emit.requests) - set(emit.reasons))
                raise OutsideEngineError(f"engine={self.name} ended a batch before requests {short} reached their "
                                         "max_new_tokens or a stop token")
            outputs |= emit.outputs
            for _, request in batch:
                queue.finished(request.request_id, timeline.requests[request.request_id].finish - t0)
        return outputs
