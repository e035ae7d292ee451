"""The waiting queue of one worker and its admission policies.

Rule 1: preempted requests go to the front (most recently preempted first) and are
        admitted before any other; otherwise the policy picks: ``fcfs`` the oldest arrival
        (a deque), ``priority`` the lowest ``priority`` then the oldest, ``sjf`` the
        smallest ``max_tokens`` then the oldest, ``ljf`` the largest; ties by the order
        they were queued (a heap with lazy deletion).
Rule 2: ``len`` (``count``) is exact at all times, removals included.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from inference_lab.core.engine.request import Request

__all__ = ["WaitQueue"]


class WaitQueue:
    """The waiting queue of one worker (Rules 1 and 2)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.front: deque[Request] = deque()
        self.fifo: deque[Request] = deque()
        self.heap: list[tuple[Any, ...]] = []
        self.removed: set[int] = set()
        self.count = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self.count

    def push(self, r: Request) -> None:
        """Queue a request that arrived (not a preempted one: :meth:`push_front`)."""
        self.count += 1
        if self.policy == "fcfs":
            self.fifo.append(r)
            return
        if self.policy == "priority":
            key: tuple[Any, ...] = (r.priority, r.arrival_time)
        elif self.policy == "sjf":
            key = (r.max_tokens, r.arrival_time)
        else:  # ljf
            key = (-r.max_tokens, r.arrival_time)
        r.queue_key = (*key, next(self._seq))
        heapq.heappush(self.heap, (*r.queue_key, r))

    def push_front(self, r: Request) -> None:
        """Queue a preempted request ahead of every other."""
        self.count += 1
        self.front.appendleft(r)

    def _clean_heap(self) -> None:
        heap = self.heap
        while heap and heap[0][-1].id in self.removed:
            self.removed.discard(heapq.heappop(heap)[-1].id)

    def peek(self) -> Request | None:
        """The request the scheduler would admit next, or None."""
        if self.front:
            return self.front[0]
        if self.policy == "fcfs":
            return self.fifo[0] if self.fifo else None
        self._clean_heap()
        return self.heap[0][-1] if self.heap else None

    def pop(self) -> Request:
        """Take the request :meth:`peek` returns (the caller knows there is one)."""
        self.count -= 1
        if self.front:
            return self.front.popleft()
        if self.policy == "fcfs":
            return self.fifo.popleft()
        self._clean_heap()
        r: Request = heapq.heappop(self.heap)[-1]
        return r

    def pop_head(self) -> tuple[Request, bool]:
        """Take the head (:meth:`peek`'s) aside: it and whether it was at the front, for
        :meth:`restore` (a head the scheduler skips: lora Rule 1)."""
        front = bool(self.front)
        return self.pop(), front

    def restore(self, taken: list[tuple[Request, bool]]) -> None:
        """Put back requests :meth:`pop_head` took, in the order they were taken: each
        where it was (the front, the head of the FIFO, or the heap under its own key), so
        the queue's order is as if they had never left (Rule 1)."""
        for r, front in reversed(taken):
            self.count += 1
            if front:
                self.front.appendleft(r)
            elif self.policy == "fcfs":
                self.fifo.appendleft(r)
            else:
                heapq.heappush(self.heap, (*r.queue_key, r))

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (front first; a heap policy's in heap order)."""
        yield from self.front
        if self.policy == "fcfs":
            yield from self.fifo
        else:
            removed = self.removed
            yield from (e[-1] for e in self.heap if e[-1].id not in removed)

    def in_order(self) -> list[Request]:
        """The queued requests in the order the scheduler admits them."""
        if self.policy == "fcfs":
            return [*self.front, *self.fifo]
        live = sorted(e for e in self.heap if e[-1].id not in self.removed)
        return [*self.front, *(e[-1] for e in live)]

    def remove(self, r: Request) -> None:
        """Take ``r`` (queued) out, wherever it is."""
        if r in self.front:
            self.front.remove(r)
        elif self.policy == "fcfs":
            self.fifo.remove(r)
        else:
            self.removed.add(r.id)
        self.count -= 1
