"""The engine's event calendar: arrivals and step boundaries in time order.

Rule 1: events at the same time are handled in the order they were filed (each carries a
        sequence number from one counter); an arrival filed with ``preorder`` ``i`` is
        ordered as if it had been filed before anything else, as the ``i``-th such
        arrival (the simulator's lazy feed of an open loop: engine Rule 6).
Rule 2: an event is never removed from the heap; it goes stale instead and is skipped
        when it reaches the top: an arrival whose request is no longer PENDING (it was
        aborted), a transfer's end whose request is no longer RECEIVING (aborted), a
        boundary whose sequence number is not its owner's ``boundary_seq`` (the step end
        moved when a late arrival joined the step: engine Rule 2).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import Any, Protocol

from inference_lab.core.engine.request import PENDING, RECEIVING, Request

__all__ = ["ARRIVAL", "BOUNDARY", "GROUP_BOUNDARY", "TRANSFER", "EventCalendar", "EventKind"]

#: Sequence numbers of arrivals filed with ``preorder`` start here: below every number
#: the calendar's own counter gives (Rule 1).
PREORDER_BASE = 1 << 62


class EventKind(enum.IntEnum):
    """What an event is."""

    #: a request's arrival (payload: the request)
    ARRIVAL = 0
    #: the end of a worker's step in flight (payload: the worker's scheduler)
    BOUNDARY = 1
    #: the end of the lockstep step of a replica's data-parallel ranks (payload: the group)
    GROUP_BOUNDARY = 2
    #: a remote prefill's KV has arrived at its decode worker (payload: the request)
    TRANSFER = 3


ARRIVAL = EventKind.ARRIVAL
BOUNDARY = EventKind.BOUNDARY
GROUP_BOUNDARY = EventKind.GROUP_BOUNDARY
TRANSFER = EventKind.TRANSFER


class BoundaryOwner(Protocol):
    """A worker or a data-parallel group: the sequence number of its live boundary."""

    boundary_seq: int


class EventCalendar:
    """A heap of ``(time, sequence, kind, payload)`` (Rules 1 and 2)."""

    __slots__ = ("heap", "_seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()

    def file_arrival(self, r: Request, time: float, preorder: int | None = None) -> None:
        """File the arrival of ``r`` at ``time`` (with ``preorder``: Rule 1)."""
        seq = next(self._seq) if preorder is None else preorder - PREORDER_BASE
        heapq.heappush(self.heap, (time, seq, ARRIVAL, r))

    def file_transfer(self, r: Request, time: float) -> None:
        """File the end of ``r``'s KV transfer (it is RECEIVING) at ``time``."""
        heapq.heappush(self.heap, (time, next(self._seq), TRANSFER, r))

    def file_boundary(self, owner: BoundaryOwner, time: float, kind: EventKind) -> None:
        """File ``owner``'s step boundary at ``time``; any boundary it had filed goes
        stale (Rule 2)."""
        owner.boundary_seq = seq = next(self._seq)
        heapq.heappush(self.heap, (time, seq, kind, owner))

    def next_time(self) -> float | None:
        """The time of the earliest live event, or None (stale ones are dropped)."""
        heap = self.heap
        while heap:
            _, seq, kind, payload = heap[0]
            if kind == ARRIVAL:
                if payload.status == PENDING:
                    break
            elif kind == TRANSFER:
                if payload.status == RECEIVING:
                    break
            elif seq == payload.boundary_seq:
                break
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def top(self) -> tuple[float, int, int, Any] | None:
        """The earliest live event's entry ``(time, sequence, kind, payload)``, or None
        (stale ones are dropped): :meth:`next_time` and what :meth:`pop` would take, in
        one look; :meth:`drop_top` then takes it."""
        heap = self.heap
        while heap:
            top = heap[0]
            kind = top[2]
            if kind == ARRIVAL:
                if top[3].status == PENDING:
                    return top
            elif kind == TRANSFER:
                if top[3].status == RECEIVING:
                    return top
            elif top[1] == top[3].boundary_seq:
                return top
            heapq.heappop(heap)
        return None

    def drop_top(self) -> None:
        """Take the earliest event, live as :meth:`top` found it."""
        heapq.heappop(self.heap)

    def pop(self) -> tuple[float, int, Any]:
        """Take the earliest live event: (time, kind, payload). Raises RuntimeError when
        there is none."""
        heap = self.heap
        pop = heapq.heappop
        while True:
            if not heap:
                raise RuntimeError("step() called with no event pending")
            t, seq, kind, payload = pop(heap)
            if kind == ARRIVAL:
                if payload.status == PENDING:
                    return t, kind, payload
            elif kind == TRANSFER:
                if payload.status == RECEIVING:
                    return t, kind, payload
            elif seq == payload.boundary_seq:
                return t, kind, payload
