"""Per-request sinks and the delivery of stream frames to the wire.

The engine task hands each request's output to its sink by synchronous calls (a counter
update per step); the request's own task writes what is pending when it runs, unless the
hand-over could write it at once (Rule 7). How often a stream writes mid-stream is
decided by :class:`Delivery` from the measured load of the event loop, not from the
number of open streams.

Rule 1: everything pending for a stream goes out in one write; the last token, the finish
        frame, the usage frame and ``[DONE]`` are one ``http.response.body`` message, the
        one that ends the body.
Rule 2: a stream's first token and its end (finish, an error, ``[DONE]``) are never held
        back. Only mid-stream tokens may wait, and only while the loop is saturated, for
        at most :attr:`Delivery.interval` after the stream's previous write, so a busy CPU
        shows up as coarser delivery, never as slower generation.
Rule 3: a slow reader only delays its own writes; the engine never waits for a writer.
Rule 4: a client that goes away ends its writer at its next wake-up with nothing more
        written (the caller aborts the request in the engine).
Rule 5: a stream's response start shares the socket write of its first frames when they
        are pending at once (a chat stream's role frame) or when the loop is saturated
        (:attr:`Delivery.interval` > 0: one write less per request where the CPU is the
        limit, the headers then arriving with the first token); otherwise the start is
        written at once, while the prefill runs. Either way the HTTP stack encodes the
        start when the engine has taken the request (which then sees the arrival as
        early as the server can hand it over), not on the first token's path -- except
        for the only request of an idle engine (``RequestHandle.alone``): when the engine
        takes that one moves none of its steps, so its start is sent first, and its first
        token can then be written by the hand-over (Rule 7) instead of by a writer woken
        to send it with the start.
Rule 6: on a connection that takes them (:func:`~inference_lab.serve.transport.chunk_writer`:
        the hooked transport's, HTTP/1.1, chunked), frames are written as pre-framed
        chunks straight to the connection; only the response start and the end of the
        body go through the HTTP stack's own state machines.
Rule 7: a mid-stream token handed to a stream whose writer is parked for frames is
        written by the hand-over itself (:meth:`StreamSink.on_tokens`, synchronously, on
        the engine task) when the response has started on a connection that takes
        pre-framed chunks (Rule 6), nobody holds that connection's send lock or gathers a
        write on it, and delivery is not spacing writes (:attr:`Delivery.interval` 0): the
        writer is not woken and scheduled for each token (``scripts/bench_stack.py``
        measures the CPU this saves), and the token leaves one scheduler pass
        sooner. A stream's last token never goes this way (it leaves with the end, Rule
        1); what the socket's buffer did not take is left to the writer, which sends it
        before anything newer, so the engine still never waits for a client (Rule 3).
Rule 8: so does a stream's end (its last tokens, the end frames and the chunked body's
        terminator, in one write: Rule 1), under the same conditions but whatever the
        delivery's spacing (Rule 2: an end is never held back): a wave of streams that
        end in one step (closed-loop clients in lock-step) leaves in that step's
        hand-over, not one woken writer after another. The writer, woken by the end,
        then only ends the response in the HTTP stack (its terminator, already on the
        wire, not written again: ``ChunkWriter.end_nowait``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from inference_lab.api.encoding import StreamEncoder
from inference_lab.core.engine import Finished
from inference_lab.serve.error_replies import (
    Reply,
    engine_failed_reply,
    shutting_down_reply,
    stream_failure_frames,
)
from inference_lab.serve.transport import ChunkWriter, chunk_writer, one_write

__all__ = ["CollectSink", "Delivery", "LoopMonitor", "StreamSink", "write_stream"]

Send = Callable[[dict[str, Any]], Awaitable[None]]


class StreamSink:
    """A streaming request's pending output: the opening frame, a count of token frames
    not yet written (``written .. emitted``, encoded only when written) and the end
    frames. The engine task's per-token work is a counter update.

    ``waiting`` is set while the writer is parked for frames: new tokens wake it. ``hold``
    is set while the writer deliberately waits (see :class:`Delivery`): new tokens then do
    not wake it, the end of the stream does. ``gone`` is set when the client left."""

    __slots__ = (
        "encoder",
        "opening",
        "written",
        "emitted",
        "closing",
        "done",
        "finished",
        "gone",
        "lot",
        "hold",
        "hold_until",
        "waiting",
        "last",
        "direct",
        "delivery",
        "unsent",
        "ended",
        "woken",
    )

    def __init__(self, encoder: StreamEncoder) -> None:
        self.encoder = encoder
        self.opening = encoder.opening()
        self.written = 0
        self.emitted = 0
        self.closing = b""
        self.done = False
        self.finished = False
        self.gone = False
        self.hold = False
        self.hold_until = 0.0
        self.waiting = False
        self.lot = trio.lowlevel.ParkingLot()
        #: The stream's token count when it runs to its end (0: unknown); below it, a
        #: token is mid-stream (set by the caller once the engine admitted the request).
        self.last = 0
        #: Where the engine's hand-over may write mid-stream tokens itself (Rule 7), set
        #: by the writer once the response has started: the connection and the delivery.
        self.direct: ChunkWriter | None = None
        self.delivery: Delivery | None = None
        #: What such a write left over (a framed chunk's tail): the writer sends it first.
        self.unsent = b""
        #: The hand-over wrote the stream's end (Rule 8): the writer only ends the response.
        self.ended = False
        #: A hand-over woke the parked writer, which has not run since: it has taken
        #: nothing, so the stream's end may still be written for it (Rule 8).
        self.woken = False

    def pending(self) -> bool:
        return bool(self.opening or self.emitted > self.written or self.closing or self.unsent)

    def take(self) -> bytes:
        """Everything pending, in order (opening, tokens, end), marked written. Once the
        request has finished, its last token is encoded as the text's last word."""
        data = self.opening
        self.opening = b""
        if self.emitted > self.written:
            data += self.encoder.tokens(self.written, self.emitted, final=self.finished)
            self.written = self.emitted
        if self.closing:
            data += self.closing
            self.closing = b""
        return data

    def on_tokens(self, count: int) -> None:
        self.emitted += count
        # Wake the writer if it is parked for frames (a busy writer finds the frames when
        # it comes back; a holding one when its hold-back ends).
        if self.waiting:
            if self.emitted < self.last and self._write_direct():
                return  # written (Rule 7): the writer stays parked
            self.waiting = False
            self.woken = True
            self.lot.unpark_all()

    def _write_direct(self) -> bool:
        """Write the pending mid-stream tokens now, from the engine's hand-over, if nothing
        stands in the way (Rule 7); True when all of them left."""
        direct, delivery = self.direct, self.delivery
        if (
            direct is None
            or delivery is None
            or delivery.interval > 0
            or not delivery.direct
            or not direct.ready()
        ):
            return False
        self.unsent = direct.write_nowait(self.take())
        return not self.unsent

    def on_finished(self, finished: Finished) -> None:
        self.closing = self.encoder.closing(
            finished.finish_reason, finished.output_tokens, finished.cached_tokens
        )
        self.finished = True
        if self.waiting or self.hold or self.woken:
            self._end_direct()
        self._end()

    def _end_direct(self) -> None:
        """Write the stream's end now, from the engine's hand-over, if the connection takes
        it (Rule 8); what the socket did not take is left to the writer."""
        direct, delivery = self.direct, self.delivery
        if (
            direct is None
            or delivery is None
            or not delivery.direct
            or self.unsent
            or not direct.ready()
        ):
            return
        self.unsent = direct.end_nowait(self.take())
        self.ended = True

    def on_failed(self, message: str) -> None:
        self.closing = stream_failure_frames(message)
        self._end()

    def on_gone(self) -> None:
        """The client left: the writer returns at its next wake-up, writing nothing."""
        self.gone = True
        self._end()

    def _end(self) -> None:
        self.done = True
        if self.waiting or self.hold:
            self.waiting = False
            self.lot.unpark_all()


class CollectSink:
    """A non-streaming request: wakes its handler when the request ends or the client
    leaves."""

    __slots__ = ("event", "finished", "failure", "gone")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.finished: Finished | None = None
        self.failure: str | None = None
        self.gone = False

    def on_tokens(self, count: int) -> None:
        pass

    def on_finished(self, finished: Finished) -> None:
        self.finished = finished
        self.event.set()

    def on_failed(self, message: str) -> None:
        self.failure = message
        self.event.set()

    def on_gone(self) -> None:
        self.gone = True
        self.event.set()

    def unfinished_reply(self, shutdown_message: str | None) -> Reply | None:
        """The reply to a request the engine did not finish: the shutdown's when the
        server is shutting down, else the engine failure's; None when the client left."""
        if self.gone:
            return None
        if shutdown_message is not None:
            return shutting_down_reply(shutdown_message)
        return engine_failed_reply(self.failure or "The engine failed.")


class LoopMonitor(trio.abc.Instrument):
    """How busy trio's run loop is: the share of wall-clock time spent outside the I/O
    wait (where the loop sleeps when no task can run). Installed by :class:`Delivery`
    with ``trio.lowlevel.add_instrument``; it only defines the two I/O-wait hooks, which
    trio calls once per loop iteration."""

    def __init__(self) -> None:
        self._wait_start = 0.0
        self._idle = 0.0
        self._since = time.perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        self._wait_start = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self._idle += time.perf_counter() - self._wait_start

    def busy(self) -> float:
        """The busy share (0..1) since the previous call."""
        now = time.perf_counter()
        elapsed = now - self._since
        idle, self._idle, self._since = self._idle, 0.0, now
        if elapsed <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - idle / elapsed))


@attrs.frozen(kw_only=True)
class DeliveryStatistics:
    """What :class:`Delivery` is doing (``/control/stats``)."""

    #: Streams being written now.
    open_streams: int
    #: Seconds a stream waits after a mid-stream write before the next one (0 = none).
    interval: float
    #: The event loop's busy share, smoothed over the last few control periods (0..1; 0
    #: when unmeasured).
    loop_busy: float
    #: Mid-stream writes held back so far.
    holds: int


class Delivery:
    """How often streams write mid-stream, from the measured load of the event loop.

    Every SSE write costs the HTTP stack tens of microseconds of CPU (most of it the send
    system call on loopback), and the pacer's wake-ups queue behind every runnable writer.
    While the loop is idle enough, every token is written when the engine emits it. When
    the loop's busy share, measured every control period (:attr:`PERIOD`) and smoothed
    over a few (:attr:`SMOOTHING`), passes :attr:`HIGH`, a writer that has just written
    mid-stream waits :attr:`interval` before writing the tokens that arrived meanwhile
    (all in one write); the interval grows by :attr:`GROW`
    while the loop stays busy and shrinks back to zero while it is below :attr:`LOW`, or
    by one step every :attr:`PROBE_EVERY` seconds while it is below HIGH. First tokens and
    stream ends are never held (module Rule 2).

    The hold-backs are timed by one **releaser** task (:meth:`run`, started with the
    runtimes) rather than a timeout per writer: a held writer parks, and the releaser
    wakes every writer whose hold-back has expired in one pass (a trio timeout per write
    is a cancellation, and a busy server would make thousands of them a second). The
    releaser also runs the control loop. The loop is only measured under trio's real
    clock; under a MockClock (tests) the interval is whatever :meth:`force_interval` set.
    """

    #: Seconds between control decisions.
    PERIOD = 0.05
    #: Weight of each period's measured busy share in the smoothed one the decisions use
    #: (an exponential average: a single busy period -- another process, a burst of
    #: arrivals -- does not space writes out; a loop busy for a few periods does).
    SMOOTHING = 0.3
    #: Busy share above which writes are spaced further apart ...
    HIGH = 0.75
    #: ... and below which they are brought closer again.
    LOW = 0.55
    #: Smallest non-zero interval (seconds) and the largest.
    MIN_INTERVAL = 0.001
    MAX_INTERVAL = 0.25
    #: Factor of each change of the interval.
    GROW = 1.5
    #: Seconds an interval stays unchanged while the loop's busy share lies between
    #: :attr:`LOW` and :attr:`HIGH` before one smaller step is tried (undone if the loop
    #: then passes HIGH): spacing writes out costs the holds' wake-ups and stops the
    #: hand-over's own writes (module Rule 7), the cheapest delivery there is, so a
    #: spaced-out loop can sit in that band where an unspaced one would be below HIGH.
    PROBE_EVERY = 1.0

    def __init__(self) -> None:
        self.open = 0
        self.interval = 0.0
        self.running = False
        self.busy = 0.0
        self.holds = 0
        #: Whether a parked writer's mid-stream tokens may be written by the engine's
        #: hand-over itself (module Rule 7); benchmarks turn it off for a baseline.
        self.direct = True
        self._forced: float | None = None
        self._changed = -math.inf
        self._monitor: LoopMonitor | None = None
        self._held: list[tuple[float, int, StreamSink]] = []  # heap of (until, seq, sink)
        self._seq = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._sleeping_until = math.inf
        self._scope: trio.CancelScope | None = None

    def force_interval(self, interval: float | None) -> None:
        """Fix the interval (tests, benchmarks); None returns control to the monitor."""
        self._forced = interval
        self.interval = interval if interval is not None else 0.0

    def statistics(self) -> DeliveryStatistics:
        return DeliveryStatistics(
            open_streams=self.open, interval=self.interval, loop_busy=self.busy, holds=self.holds
        )

    def decide(self, busy: float, now: float) -> float:
        """The next interval given the loop's (smoothed) busy share, at trio time ``now``
        (arithmetic on the current interval and on when it last changed; the control loop
        applies it)."""
        interval = self.interval
        if busy > self.HIGH:
            return min(self.MAX_INTERVAL, max(self.MIN_INTERVAL, interval * self.GROW))
        if interval > 0 and (busy < self.LOW or now - self._changed >= self.PROBE_EVERY):
            interval /= self.GROW
            return interval if interval >= self.MIN_INTERVAL else 0.0
        return interval

    def hold(self, sink: StreamSink, until: float) -> None:
        """Have the releaser wake ``sink``'s writer at ``until`` (unless it has stopped
        holding by then: ``sink.hold_until`` names the hold-back an entry belongs to)."""
        sink.hold_until = until
        self._seq += 1
        self.holds += 1
        heapq.heappush(self._held, (until, self._seq, sink))
        if until < self._sleeping_until:
            self._lot.unpark_all()  # the releaser sleeps too long (or idles): re-arm it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The releaser and control loop (runs until :meth:`stop` or cancellation)."""
        held = self._held
        self.running = True
        self._scope = trio.CancelScope()
        real_clock = type(trio.lowlevel.current_clock()).__name__ == "SystemClock"
        if real_clock and self._forced is None:
            self._monitor = LoopMonitor()
            trio.lowlevel.add_instrument(self._monitor)
        task_status.started()
        try:
            with self._scope:
                await self._release(held)
        finally:
            self.running = False
            self._sleeping_until = math.inf
            if self._monitor is not None:
                trio.lowlevel.remove_instrument(self._monitor)
                self._monitor = None
            for _, _, sink in held:
                sink.lot.unpark_all()
            held.clear()

    def stop(self) -> None:
        """End the releaser (the serving teardown calls it: hypercorn would otherwise wait
        for it). Held writers are woken and time their own hold-backs from then on."""
        if self._scope is not None:
            self._scope.cancel()

    def _control(self, now: float) -> float:
        """Apply a control decision if a period has passed; the time of the next one."""
        monitor = self._monitor
        if monitor is None or self._forced is not None:
            return math.inf
        self.busy += self.SMOOTHING * (monitor.busy() - self.busy)
        interval = self.decide(self.busy, now)
        if interval != self.interval:
            self.interval, self._changed = interval, now
        return now + self.PERIOD

    async def _release(self, held: list[tuple[float, int, StreamSink]]) -> None:
        """Wake held writers whose hold-back has ended; decide the interval every
        period; sleep until whichever comes next."""
        lot = self._lot
        next_control = self._control(trio.current_time())
        while True:
            now = trio.current_time()
            if now >= next_control:
                next_control = self._control(now)
            while held and held[0][0] <= now:
                until, _, sink = heapq.heappop(held)
                if sink.hold and sink.hold_until == until:
                    sink.lot.unpark_all()
            wake = min(held[0][0] if held else math.inf, next_control)
            self._sleeping_until = wake
            if wake < math.inf:
                with trio.move_on_at(wake):
                    await lot.park()
            else:
                await lot.park()


async def write_stream(
    send: Send, sink: StreamSink, delivery: Delivery, start: dict[str, Any] | None = None
) -> None:
    """Write ``sink``'s frames to ``send`` until the stream ends or the client leaves.

    The message that carries the end of the stream ends the body (``more_body`` False)
    and is shielded from cancellation, so a finished stream always reaches its chunked
    terminator. Called by the completion exchange once the response has started, or with
    the response's ``start`` message: that is sent at once (the HTTP stack encodes it
    now, while the prefill runs) but its bytes leave in one socket write with the first
    frames (Rule 5).
    """
    lot = sink.lot
    delivery.open += 1
    chunks = None if start is not None else chunk_writer(send)
    sink.direct, sink.delivery = chunks, delivery  # (None until the response has started)
    try:
        while True:
            if start is not None:
                async with one_write(send):
                    await send(start)
                    start = None
                    chunks = sink.direct = chunk_writer(send)
                    ended = await _write_next(send, sink, chunks)
            else:
                ended = await _write_next(send, sink, chunks)
            if ended:
                return
            interval = delivery.interval
            if interval > 0 and sink.emitted and not sink.done:
                sink.hold = True
                try:
                    if delivery.running:
                        delivery.hold(sink, trio.current_time() + interval)
                        await lot.park()  # woken by the releaser or the end of the stream
                    else:
                        with trio.move_on_after(interval):
                            await lot.park()  # woken early only by the end of the stream
                finally:
                    sink.hold = False
    finally:
        sink.direct = None
        delivery.open -= 1


async def _write_next(send: Send, sink: StreamSink, chunks: ChunkWriter | None) -> bool:
    """Wait for frames and write everything pending in one message (one pre-framed chunk
    through ``chunks`` where the connection takes them, Rule 6); True when the stream has
    ended (its last message written, or the client gone)."""
    sink.woken = False
    while not sink.pending() and not sink.ended:
        if sink.done:
            return True  # the client left (nothing more to write)
        sink.waiting = True
        try:
            await sink.lot.park()
        finally:
            sink.waiting = sink.woken = False
    if sink.gone:
        return True
    unsent, sink.unsent = sink.unsent, b""
    if sink.ended:  # the hand-over wrote the end (Rule 8): end the response, and the rest
        assert chunks is not None
        with trio.CancelScope(shield=True):
            async with one_write(send):
                await chunks.write_framed(unsent)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    data = sink.take()
    if sink.done:
        with trio.CancelScope(shield=True):
            async with one_write(send):  # the last frames and the body's end
                if chunks is not None:
                    await chunks.write_framed(unsent)
                    await chunks(data)
                    data = b""
                await send({"type": "http.response.body", "body": data, "more_body": False})
        return True
    if chunks is not None:
        await chunks.write_framed(unsent)
        await chunks(data)
    else:
        await send({"type": "http.response.body", "body": data, "more_body": True})
    return False
