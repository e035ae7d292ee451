"""The KV-event replay socket: vLLM's protocol, served at a bounded rate beside the live
stream.

A subscriber that missed batches asks the ROUTER socket for them by sequence number, as
it asks vLLM. The publisher thread (:mod:`inference_lab.serve.kv_events`) owns the socket
and gives the replay one bounded *turn* between two drains of the live queue, so no
number of requests holds live batches back for longer than one turn.

Rule 1: the protocol is vLLM's (:data:`inference_lab.serve.kv_wire.VLLM_RELEASE`): a
        request is ``[identity, b"", start]`` (``start`` big-endian; a request of any
        other frame count is ignored, as vLLM ignores it); the answer is
        ``[identity, b"", topic, seq, payload]`` for every batch still buffered with
        ``seq >= start`` and published before the request was taken, in order, then
        ``[identity, b"", b"", -1 as 8 signed bytes, b""]``. A DEALER receives the
        frames after ``identity``; a REQ socket, those after the empty one.
Rule 2: the buffer keeps the last ``size`` sequence numbers (vLLM's ``buffer_steps``):
        batch ``seq`` sits at ``seq % size``; a number whose batch was dropped before it
        was sent, or has been overwritten since, is skipped.
Rule 3: every message costs one token -- a request taken, a batch or an end marker
        sent -- from a bucket that refills at ``rate`` per second and holds one slice
        (``slice_`` tokens) at most: the replay's CPU is bounded by the rate, whatever
        is asked, and one turn spends at most a slice. Requests are taken while fewer
        than ``pending`` are being answered (the rest wait in ZeroMQ's queues, bounded
        by its high-water marks), and the requesters being answered take turns (round
        robin), so one cannot hold the others back for more than a slice at a time; one
        requester's answers go out one after the other, whole, in the order asked.
Rule 4: the socket is ``ROUTER_MANDATORY`` and sends never block: a requester that is
        gone or whose queue is full (it does not read: the queue holds one whole replay,
        as vLLM sizes it) loses the rest of its answer (counted ``abandoned``).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["END_SEQ", "ReplayBuffer", "ReplayService", "ReplayStatistics"]

#: The replay's end marker (Rule 1).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayBuffer:
    """The last ``size`` published batches by sequence number (Rule 2)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots: list[tuple[int, bytes] | None] = [None] * size
        #: The next sequence number to be stored (every one below was published or dropped).
        self.end = 0

    def append(self, seq: int, payload: bytes) -> None:
        """Keep batch ``seq`` (sequence numbers only grow)."""
        self._slots[seq % self.size] = (seq, payload)
        self.end = seq + 1

    @property
    def start(self) -> int:
        """The oldest sequence number still kept (or skipped, Rule 2)."""
        return max(0, self.end - self.size)

    def get(self, seq: int) -> bytes | None:
        """Batch ``seq``'s payload, None if it is not kept."""
        slot = self._slots[seq % self.size]
        return slot[1] if slot is not None and slot[0] == seq else None

    def __iter__(self) -> Any:
        for seq in range(self.start, self.end):
            payload = self.get(seq)
            if payload is not None:
                yield seq, payload


@attrs.define
class _Job:
    """The answer being sent to one requester, and its requests still to answer."""

    identity: bytes
    next: int
    end: int
    later: collections.deque[int] = attrs.field(factory=collections.deque)


@attrs.frozen(kw_only=True)
class ReplayStatistics:
    """What the replay socket did, for ``ModelPublisher.statistics`` and tests."""

    #: Requests taken off the socket (malformed ones included).
    requests: int
    #: Answers sent whole, end marker included.
    answered: int
    #: Answers cut short: the requester was gone or did not read (Rule 4).
    abandoned: int
    #: Batches sent in answers.
    replayed: int


class ReplayService:
    """The replay side of one publisher (see the module rules). Only the publisher thread
    calls it: :meth:`turn` between two drains of the live queue."""

    def __init__(
        self,
        socket: Any,
        zmq: Any,
        topic: bytes,
        buffer: ReplayBuffer,
        *,
        rate: float,
        slice_: int,
        pending: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._zmq = zmq
        self._topic = topic
        self._buffer = buffer
        self._rate = rate
        self._slice = slice_
        self._pending = pending
        self._clock = clock
        self._tokens = float(slice_)
        self._last = clock()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._by_identity: dict[bytes, _Job] = {}
        self._held = 0  # requests taken and not yet answered or abandoned
        self._requests = 0
        self._answered = 0
        self._abandoned = 0
        self._replayed = 0

    def statistics(self) -> ReplayStatistics:
        return ReplayStatistics(
            requests=self._requests,
            answered=self._answered,
            abandoned=self._abandoned,
            replayed=self._replayed,
        )

    def turn(self) -> float:
        """Take requests and send answers, spending at most one slice of the tokens
        available (Rule 3). Returns how long the thread may wait before the next turn
        (it may come sooner): 0 with tokens and work left, the refill time without
        tokens, ``inf`` with nothing to answer."""
        now = self._clock()
        self._tokens = min(float(self._slice), self._tokens + (now - self._last) * self._rate)
        self._last = now
        budget = int(self._tokens)
        spent = self._take_requests(budget)
        if self._jobs and spent < budget:
            job = self._jobs.popleft()
            sent, done = self._answer(job, budget - spent)
            spent += sent
            if done:
                self._held -= 1
                if job.later:  # its next request, answered from what is buffered now
                    job.next, job.end = self._bounds(job.later.popleft())
                    done = False
                else:
                    del self._by_identity[job.identity]
            if not done:
                self._jobs.append(job)
        self._tokens -= spent
        if not self._jobs and not self._socket.poll(0):
            return math.inf
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate

    def _bounds(self, start: int) -> tuple[int, int]:
        """The sequence numbers an answer to ``start`` covers, as buffered now."""
        return max(start, self._buffer.start), self._buffer.end

    def _take_requests(self, budget: int) -> int:
        spent = 0
        socket = self._socket
        while self._held < self._pending and spent < budget and socket.poll(0):
            frames = socket.recv_multipart()
            spent += 1
            self._requests += 1
            if len(frames) != 3:
                continue  # not a replay request: vLLM ignores it too
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self._held += 1
            job = self._by_identity.get(identity)
            if job is not None:
                job.later.append(start)
                continue
            first, end = self._bounds(start)
            job = _Job(identity=identity, next=first, end=end)
            self._by_identity[identity] = job
            self._jobs.append(job)
        return spent

    def _answer(self, job: _Job, budget: int) -> tuple[int, bool]:
        """Send up to ``budget`` messages of ``job``'s answer; (messages, finished)."""
        zmq = self._zmq
        send = self._socket.send_multipart
        buffer = self._buffer
        sent = 0
        job.next = max(job.next, buffer.start)  # what was overwritten meanwhile is gone
        try:
            while sent < budget:
                if job.next >= job.end:
                    send((job.identity, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
                    self._answered += 1
                    return sent + 1, True
                seq = job.next
                job.next += 1
                payload = buffer.get(seq)
                sent += 1  # a skipped number costs a token too: the loop stays bounded
                if payload is not None:
                    send(
                        (job.identity, b"", self._topic, seq.to_bytes(8, "big"), payload),
                        flags=zmq.NOBLOCK,
                    )
                    self._replayed += 1
        except zmq.ZMQError:  # gone (EHOSTUNREACH) or not reading (EAGAIN): Rule 4
            self._abandoned += 1
            return sent, True
        return sent, False
