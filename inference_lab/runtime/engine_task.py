"""The engine task of one served model: ``model_runtime.py``'s Rules 2, 3, 5, 8, 9 and 10
from the engine's side.

:class:`EngineTask` holds the methods that run on the engine task -- taking the inbox's
messages, stepping the events whose time has come, handing each step's tokens to the
requests' sinks, and telling the pacer the next deadline.
:class:`~inference_lab.runtime.model_runtime.ModelRuntime` inherits them and holds the
state they share (set in its ``__init__``); the messages its HTTP side and its pacer send
the engine task are defined here.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import attrs
import trio

from inference_lab.core.admission import Admission
from inference_lab.core.engine import Engine, StepEvents
from inference_lab.errors import RequestRefused
from inference_lab.runtime.calibration import EarlyWake
from inference_lab.runtime.interface import KVEventSink, RequestHandle, RuntimeObserver
from inference_lab.runtime.lag import LagMeter

__all__ = ["MAX_EVENTS_PER_WAKE", "EngineTask"]

#: At most this many engine events are handled per wake-up before the engine task lets
#: other tasks (HTTP writers) run; the pacer wakes it again at once if more are due.
MAX_EVENTS_PER_WAKE = 64


@attrs.frozen
class _Arrival:
    handle: RequestHandle


@attrs.frozen
class _Release:
    """From the HTTP side: give back the blocks a finished request held (Rule 10)."""

    request_id: int


@attrs.frozen
class _Tick:
    """From the pacer: the deadline it was given has come."""


_TICK = _Tick()
_UNSENT = object()


class EngineTask:
    """The engine task's methods of a :class:`ModelRuntime` (which sets every attribute
    declared here in its ``__init__``)."""

    engine: Engine
    epoch: float
    kv_events: KVEventSink | None
    observer: RuntimeObserver | None
    _admission: Admission
    _live: dict[RequestHandle, None]
    _by_id: dict[int, RequestHandle]
    _inbox_recv: trio.MemoryReceiveChannel[_Arrival | _Release | _Tick]
    _deadline_send: trio.MemorySendChannel[float | None]
    _sent_deadline: object
    _sleep_scope: trio.CancelScope | None
    _precise: bool
    _wake: EarlyWake
    _ticked: bool
    _taken: trio.lowlevel.ParkingLot
    _lag: LagMeter
    _e2e_samples: deque[float]

    if TYPE_CHECKING:  # ModelRuntime's own

        def _publish(self) -> None: ...

        def _fail(self, exc: BaseException) -> None: ...

    def _release_slot(self, handle: RequestHandle) -> None:
        if handle.holds_slot:
            handle.holds_slot = False
            self._admission.release(handle)

    async def _engine_task(self) -> None:
        inbox = self._inbox_recv
        try:
            while True:
                try:
                    message = await inbox.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                self._handle(message)
                while True:
                    try:
                        message = inbox.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
                    self._handle(message)
                self._run_due()
                self._send_deadline()
                if self._taken:
                    self._taken.unpark_all()
        except Exception as exc:  # noqa: BLE001 - an engine failure stops this model only
            self._fail(exc)

    def _handle(self, message: _Arrival | _Release | _Tick) -> None:
        if isinstance(message, _Tick):
            self._sent_deadline = _UNSENT  # the pacer dropped its deadline: send anew
            self._ticked = True
            return
        if isinstance(message, _Release):
            self._release_kv(message.request_id)
            return
        handle = message.handle
        if handle.done:
            return  # closed before the engine saw it; its slot is already back
        engine = self.engine
        spec = handle.spec
        if engine.is_idle() and spec.arrival_time > engine.now:
            engine.advance_to(spec.arrival_time)
        try:
            rid = engine.submit(spec)
        except RequestRefused as exc:
            handle.state = "failed"
            self._live.pop(handle, None)
            self._release_slot(handle)
            handle.sink.on_failed(exc.reason)
            return
        handle.request_id = rid
        handle.state = "submitted"
        self._by_id[rid] = handle

    def _release_kv(self, request_id: int) -> None:
        """Rule 10: the held blocks go back now; an engine with nothing scheduled (idle,
        or stalled waiting for blocks) first moves its clock up to now, so a worker the
        release wakes starts its step now, not in the past."""
        engine = self.engine
        t = trio.current_time() - self.epoch
        if engine.next_event_time() is None and t > engine.now:
            engine.advance_to(t)
        if engine.release_kv(request_id):
            self._admission.changed()

    def _run_due(self) -> None:
        """Step every event whose time has come (at most MAX_EVENTS_PER_WAKE)."""
        engine = self.engine
        epoch = self.epoch
        observer = self.observer
        # Compare in wall-clock terms, exactly as the pacer sleeps (until epoch + t): in
        # floating point, now - epoch < t can hold although epoch + t <= now.
        now = trio.current_time()
        wake = self._wake
        lag_meter = self._lag
        horizon = now + wake.early
        # Only a wake-up by the pacer's timer says how late the timer lands: an arrival
        # into an idle engine also finds its (back-dated) first step due.
        first = self._ticked and self._precise
        self._ticked = False
        latest = -1.0  # the first event's lag: the pass's largest (one `now`, events in order)
        for _ in range(MAX_EVENTS_PER_WAKE):
            t = engine.next_event_time()
            if t is None or epoch + t > horizon:
                break
            events = engine.step()
            signed = now - (epoch + t)
            if first:
                # how late the step's tokens start to leave: the pacer's timer, its
                # hand-over to this task and the step's own computation
                wake.learn(trio.current_time() - (epoch + t))
                first = False
            lag: float | None = None
            if events.tokens or events.finished:  # model_runtime Rule 2: what a client sees
                lag = signed if signed > 0.0 else 0.0
                lag_meter.record(lag)
                if latest < 0.0:
                    latest = lag
            self._deliver(events)
            if observer is not None:
                observer.on_step(events, lag)
        if latest >= 0.0:
            lag_meter.latest = latest
        lag_meter.tick(now)
        for rid in engine.take_kv_arrived():  # Rule 10
            arrived = self._by_id.get(rid)
            if arrived is not None and arrived.on_kv_arrived is not None:
                arrived.on_kv_arrived()
        if self.kv_events is not None:
            kv = engine.take_kv_events()
            if kv:
                self.kv_events(kv)
        self._publish()

    def _deliver(self, events: StepEvents) -> None:
        self._admission.changed()  # the engine moved: its queues, batch or blocks
        by_id = self._by_id
        if events.arrived:
            self._publish()  # the new waiting count first ...
            for rid in events.arrived:
                handle = by_id.get(rid)
                if handle is not None:
                    self._release_slot(handle)  # ... then the pending slots
        # Latest admitted first: a stream whose prefill just ended (its first token) is
        # handed its token before the step's mid-stream ones (Rule 9).
        for rid, count in reversed(events.tokens):
            handle = by_id.get(rid)
            if handle is not None:
                handle.sink.on_tokens(count)
        for finished in events.finished:
            self._e2e_samples.append(finished.finish_time - finished.arrival_time)
            handle = by_id.pop(finished.request_id, None)
            if handle is not None:
                handle.state = "finished"
                self._live.pop(handle, None)
                handle.sink.on_finished(finished)
                if self.observer is not None:
                    self.observer.on_finished_request(finished, handle.spec.max_tokens)

    def _send_deadline(self) -> None:
        nxt = self.engine.next_event_time()
        if nxt != self._sent_deadline:
            self._sent_deadline = nxt
            self._deadline_send.send_nowait(nxt)
            if self._sleep_scope is not None:
                self._sleep_scope.cancel()  # the pacer sleeps on an older deadline
