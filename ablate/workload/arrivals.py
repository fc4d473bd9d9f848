"""When each request of a workload is sent: at its own time, or after another request finishes.

A timed request (Request.follows is None) is due `arrival_time` seconds after the start. A request
that follows another (a closed-loop user who waits for each reply) is due `arrival_time` seconds
(its think time) after that request finishes, a moment known only while the workload runs. The
ArrivalQueue keeps both kinds; whoever serves the workload (the engine, or a driver of an outside
server) asks it what is due, tells it what finished, and sleeps until `next_time()`:

    queue = ArrivalQueue(requests)
    while not queue.empty or work_left():
        for arrival_s, request in queue.due(elapsed()):    # send each; it arrived at arrival_s
            ...
        ... queue.finished(request_id, elapsed()) for each request that finished ...

Times are seconds after the start of the workload, the caller's clock.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from ablate.api.sequence import Request


class ArrivalQueue:
    def __init__(self, requests: Sequence[Request]) -> None:
        # (due time, position in `requests`, request): timed ones from the start, followers once
        # released; the position breaks ties, so equal times keep the order they were given in
        self._due: list[tuple[float, int, Request]] = []
        self._followers: dict[int, list[tuple[int, Request]]] = {}   # request id -> those waiting for it
        by_id: dict[int, Request] = {}
        for position, request in enumerate(requests):
            if request.request_id in by_id:
                raise ValueError(f"request id {request.request_id} appears twice in the workload: ids must be unique")
            by_id[request.request_id] = request
            if request.follows is None:
                self._due.append((request.arrival_time, position, request))
            else:
                self._followers.setdefault(request.follows, []).append((position, request))
        heapq.heapify(self._due)
        _check_chains(by_id)

    @property
    def empty(self) -> bool:
        """Every request has been handed out by due()."""
        return not self._due and not self._followers

    def due(self, elapsed: float) -> list[tuple[float, Request]]:
        """(arrival time, request) of each request due by `elapsed`, earliest first, each handed
        out once. A follower's arrival time is its predecessor's finish + its think time."""
        ready = []
        while self._due and self._due[0][0] <= elapsed:
            arrival_s, _, request = heapq.heappop(self._due)
            ready.append((arrival_s, request))
        return ready

    def finished(self, request_id: int, elapsed: float) -> None:
        """Request `request_id` finished at `elapsed`: those that follow it become due after their think time."""
        for position, request in self._followers.pop(request_id, []):
            heapq.heappush(self._due, (elapsed + request.arrival_time, position, request))

    def next_time(self) -> float | None:
        """When the next request is due; None when none is known yet (the rest wait on a finish) or none is left."""
        return self._due[0][0] if self._due else None


def _check_chains(by_id: dict[int, Request]) -> None:
    """Every chain of `follows` ends at a timed request of the workload: otherwise some request
    would wait forever (for an id that is not there, or for itself through a cycle)."""
    rooted: set[int] = set()
    for request in by_id.values():
        chain: list[int] = []
        current = request
        while current.follows is not None and current.request_id not in rooted:
            if current.request_id in chain:
                cycle = " -> ".join(str(i) for i in chain[chain.index(current.request_id):])
                raise ValueError(f"requests {cycle} -> {current.request_id} follow each other in a cycle: "
                                 "none of them would ever be sent")
            chain.append(current.request_id)
            if current.follows not in by_id:
                raise ValueError(f"request {current.request_id} follows request {current.follows}, which is not "
                                 "in the workload: it would never be sent")
            current = by_id[current.follows]
        rooted.update(chain)
