"""The trio runtime of one served model: an engine task and a pacer task.

``docs/internals.md`` describes the runtime's shape, its pacing and its admission. The
HTTP app talks to it through three synchronous calls (:meth:`ModelRuntime.admit_nowait`,
:meth:`RequestHandle.close`, :meth:`ModelRuntime.set_capacity`) and reads
:meth:`ModelRuntime.snapshot`.

Rule 1: one nursery per model holds the engine task, which owns the :class:`Engine`, and
        the pacer task, which owns wall-clock time; memory channels link them.
Rule 2: the engine does not run ahead of wall-clock: it steps an event once its time has
        come, less the pacer's learned early wake under trio's real clock
        (:mod:`inference_lab.runtime.calibration`), which is learned from when the
        ``step()`` of a timer's wake-up returned, so that it covers the step's own
        computation too. A step's tokens are released when the ``step()`` handling its
        end returns them; how late the engine task took up an event that released tokens
        or ended requests is the pacing lag (:mod:`inference_lab.runtime.lag`). An event
        that releases neither (an arrival, a step's start, a KV transfer's end) is seen
        by no client, and a back-dated arrival's (Rule 3) is due before the engine could
        know of it: counting those would report a request's way in as lateness.
Rule 3: an arrival is stamped with wall-clock time, and an idle engine's clock is moved up
        to it first, so a request into a long-idle server is paced like one under load.
        An arrival stamped before a boundary still joins the step in flight (engine
        Rule 2), so waking early loses no arrival.
Rule 4: admission is one synchronous function with no checkpoint: engine alive, then a
        seat or a waiting place from the admission ledger (:mod:`inference_lab.core.admission`: refused
        only when there is neither), then a ``send_nowait`` into the engine task. Each
        handle is pending in the ledger at most once and leaves it exactly once (stepped
        into a waiting queue, aborted, failed send, engine stopped).
Rule 5: the engine never awaits a client: it hands tokens to each request's
        :class:`RequestSink` by synchronous calls; aborts are synchronous too.
Rule 6: after every change the runtime publishes a frozen :class:`RuntimeSnapshot`; the
        HTTP layer reads only snapshots.
Rule 7: an engine failure stops only this model: the inbox is closed (new requests get
        503), every live request is told ``on_failed``, and the exception does not leave
        the runtime's nursery.
Rule 8: with a ``kv_events`` sink the engine records its KV-cache events, and the engine
        task hands them over once per wake-up that stepped, in one synchronous call that
        must not block (the serve app's publisher queues them for its own thread).
Rule 9: a step's tokens are handed over in the reverse of the engine's order, which is
        the running requests' admission order: a stream whose first token the step
        brings (its prefill just ended: the latest admitted of the step's emitters) is
        written before the step's mid-stream tokens, whose writes would otherwise delay
        it (a few tens of microseconds each on a socket).
Rule 10: prefill/decode hand-offs (``serve --role``): a request admitted with
        ``hold_kv`` keeps its blocks once finished until :meth:`ModelRuntime.release_kv`,
        which the engine task carries out in order with the arrivals; a request admitted
        with ``remote_positions`` has its handle's ``on_kv_arrived`` called by the engine
        task in the wake-up whose step received its KV.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, Protocol

import attrs
import numpy as np
import trio

from inference_lab.core.admission import Admission
from inference_lab.core.config import Deployment
from inference_lab.core.engine import (
    Engine,
    EngineStatistics,
    Finished,
    KVEvent,
    RequestSpec,
    StepEvents,
)
from inference_lab.errors import EngineSleeping, EngineUnavailable, QueueFull, RequestRefused
from inference_lab.runtime.calibration import EarlyWake, PacingCalibration
from inference_lab.runtime.lag import LagMeter, LagStatistics
from inference_lab.runtime.timer import Timer

__all__ = [
    "CapacityChange",
    "EngineKilled",
    "KVEventSink",
    "LengthSampler",
    "ModelRuntime",
    "RequestHandle",
    "RequestSink",
    "RuntimeObserver",
    "RuntimeSnapshot",
    "RuntimeStatistics",
]

logger = logging.getLogger("inference_lab.serve")

#: At most this many engine events are handled per wake-up before the engine task lets
#: other tasks (HTTP writers) run; the pacer wakes it again at once if more are due.
MAX_EVENTS_PER_WAKE = 64
#: Simulated E2E samples kept for the median in :meth:`ModelRuntime.statistics`.
E2E_SAMPLES = 65536
#: The largest ``Retry-After`` of a refusal, in seconds.
RETRY_AFTER_MAX = 60
#: Capacity changes kept in :attr:`ModelRuntime.capacity_changes` (the newest).
CAPACITY_HISTORY = 256


class EngineKilled(Exception):
    """The failure :meth:`ModelRuntime.kill` injects: a crash on request."""


class RequestSink(Protocol):
    """Where the engine task delivers one request's output. Every method is called
    synchronously from the engine task and must not block; after ``on_finished`` or
    ``on_failed`` nothing more is called."""

    def on_tokens(self, count: int) -> None: ...

    def on_finished(self, finished: Finished) -> None: ...

    def on_failed(self, message: str) -> None: ...


#: Takes the KV-cache events of a wake-up (synchronous, must not block: Rule 8).
KVEventSink = Callable[[tuple[KVEvent, ...]], None]


class LengthSampler(Protocol):
    def sample(self, rng: np.random.Generator, size: int) -> Any: ...


class RuntimeObserver(Protocol):
    """Told what a runtime did, for metrics (``ModelRuntime.observer``). ``on_step`` is
    called on the engine task after each step's events were delivered, with the step's
    pacing lag; ``on_finished_request`` for each request a step finished, with the
    ``max_tokens`` it was admitted with; ``on_refused`` by
    :meth:`ModelRuntime.admit_nowait` for each refusal; ``on_aborted`` with the worker of
    an aborted request. All are synchronous, must not block or raise, and must stay O(1)
    per engine event: they run inside the pacing loop."""

    def on_step(self, events: StepEvents, lag: float | None) -> None: ...

    def on_refused(
        self, reason: Literal["queue_saturated", "engine_unavailable", "engine_sleeping"]
    ) -> None: ...

    def on_aborted(self, worker: int) -> None: ...

    def on_finished_request(self, finished: Finished, max_tokens: int) -> None: ...


@attrs.frozen(kw_only=True)
class RuntimeSnapshot:
    """What the HTTP layer may know about a model, published after every change.

    ``waiting`` counts requests in the engine's waiting queues; ``pending`` the arrivals
    admitted but not yet stepped into one (``queued`` is their sum); ``depth`` those of
    them holding waiting places, not seats (what ``max_waiting`` bounds). Pacing lag
    (seconds) is how late engine events were handled. A stopped engine reports nothing
    running, waiting or pending.
    """

    #: The model's name.
    model: str
    #: Whether its engine task runs (False: new requests get 503).
    alive: bool
    #: Requests in the engine's waiting queues.
    waiting: int
    #: Arrivals admitted by the HTTP layer that the engine has not yet queued.
    pending: int
    #: Queued requests holding waiting places (:mod:`inference_lab.core.admission`). With no bound, an
    #: estimate: those queued beyond the free seats.
    depth: int
    #: Requests running (summed over workers).
    running: int
    #: The per-worker cap on running sequences in force.
    max_num_seqs: int
    #: The waiting bound in force (0: never refuse).
    max_waiting: int
    #: Requests admitted since the runtime was built.
    admitted: int
    #: Requests refused with 529 since the runtime was built.
    refused: int
    #: Admitted requests ended before they finished (their client left, or a fault
    #: ended them) since the runtime was built.
    aborted: int
    #: Engine events handled that released tokens or ended requests (each one's pacing
    #: lag is recorded, Rule 2).
    events: int
    #: The largest pacing lag so far (seconds).
    lag_max: float
    #: The mean pacing lag so far (seconds).
    lag_mean: float

    @property
    def queued(self) -> int:
        """Requests admitted and not running: ``waiting + pending``."""
        return self.waiting + self.pending


@attrs.frozen(kw_only=True)
class CapacityChange:
    """One :meth:`ModelRuntime.set_capacity` call: when (trio time) and the dials in
    force after it (for the dashboard's time axis)."""

    time: float
    max_num_seqs: int
    max_waiting: int


@attrs.frozen(kw_only=True)
class RuntimeStatistics:
    """A fuller, costlier picture for ``/control/stats`` and benchmarks."""

    #: The snapshot published last.
    snapshot: RuntimeSnapshot
    #: The engine's own statistics (queues, KV blocks, counters).
    engine: EngineStatistics
    #: The engine's simulated clock (seconds since the runtime started).
    sim_time: float
    #: Wall-clock seconds since the runtime started.
    wall_time: float
    #: The pacing lag (percentiles over the requested number of recent events).
    lag: LagStatistics
    #: Whether the pacer sleeps on a timerfd (sub-millisecond) rather than trio's timer.
    precise_timer: bool
    #: How early the pacer wakes the engine and from how many wake-ups that was learned.
    calibration: PacingCalibration
    #: How many completions the simulated E2E median is over, and that median (seconds).
    e2e_count: int
    e2e_p50: float


@attrs.define(eq=False, kw_only=True)
class RequestHandle:
    """One admitted request, owned by the HTTP handler that admitted it.

    :meth:`close` is the one cleanup call: synchronous and idempotent; it aborts the
    request in the engine unless it already finished or failed.
    """

    runtime: ModelRuntime
    spec: RequestSpec
    sink: RequestSink
    request_id: int | None = None
    holds_slot: bool = True
    state: Literal["queued", "submitted", "finished", "aborted", "failed"] = "queued"
    #: Called (synchronously, from the engine task) when its remote prefill's KV has
    #: arrived (``remote_positions``: Rule 10); None: nobody is told.
    on_kv_arrived: Callable[[], None] | None = None

    def close(self) -> None:
        self.runtime._close(self)

    def withdraw(self) -> None:
        """Undo this admission, as if it had been refused: for a request that several
        admissions serve together (an embeddings batch) when a later one is refused.
        Synchronous; only before the engine task has taken it (no checkpoint since
        :meth:`ModelRuntime.admit_nowait`), and it is not counted as admitted or aborted."""
        self.runtime._close(self, withdrawn=True)

    async def wait_taken(self) -> None:
        """Return once the engine task has taken this request: it is in the engine (its
        first step is scheduled if one could start) or it ended. The completion route
        waits for this before it spends CPU on its response's start, so the engine sees
        an arrival as early as the server can hand it over."""
        lot = self.runtime._taken
        while self.state == "queued":
            await lot.park()

    @property
    def alone(self) -> bool:
        """Whether this is the only request its runtime holds (nothing else admitted and
        not yet done): the engine is idle but for it, so when the engine takes it does
        not move its steps (an idle engine's clock starts at the arrival, Rule 3)."""
        live = self.runtime._live
        return len(live) == 1 and self in live

    @property
    def length(self) -> int:
        """How many tokens each of its sequences produces if it runs to its end (the
        length drawn for it, else ``max_tokens``); an abort or a failure ends it sooner."""
        spec = self.spec
        return spec.max_tokens if spec.target is None else spec.target

    @property
    def done(self) -> bool:
        return self.state in ("finished", "aborted", "failed")


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


class ModelRuntime:
    """The engine of one served model, paced to wall-clock (see the module rules).

    Created by the serve app; :meth:`run` is started once in a nursery
    (``await nursery.start(runtime.run)``) and returns after :meth:`stop` or an engine
    failure. ``engine`` may be replaced before :meth:`run` (tests inject failures so).
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        output_lengths: LengthSampler | None = None,
        rng: np.random.Generator | None = None,
        kv_events: KVEventSink | None = None,
    ) -> None:
        self.deployment = deployment
        self.name = deployment.model.name
        #: Told the engine's KV-cache events after each wake-up that stepped (Rule 8).
        self.kv_events = kv_events
        self.engine: Engine = Engine(deployment, record_kv_events=kv_events is not None)
        self.epoch = 0.0
        self._output_lengths = output_lengths
        self._rng = rng if rng is not None else np.random.default_rng(0)
        self._admission = Admission(self.engine, deployment.scheduler.max_waiting)
        self._live: dict[RequestHandle, None] = {}  # admitted, not done (insertion order)
        self._by_id: dict[int, RequestHandle] = {}  # submitted to the engine, not done
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[_Arrival | _Release | _Tick](
            math.inf
        )
        self._deadline_send, self._deadline_recv = trio.open_memory_channel[float | None](math.inf)
        self._sent_deadline: object = _UNSENT
        self._sleep_scope: trio.CancelScope | None = None
        self._precise = False
        self._wake = EarlyWake()  # how early the pacer wakes the engine (Rule 2)
        self._ticked = False  # the pacer's tick is among the messages being handled
        self._taken = trio.lowlevel.ParkingLot()  # RequestHandle.wait_taken
        self._alive = False
        self._started = False
        self._stopped = trio.Event()
        self._cancel_scope: trio.CancelScope | None = None
        self._admitted = 0
        self._refused = 0
        self._aborted = 0
        self._lag = LagMeter(self.name)
        self._e2e_samples: deque[float] = deque(maxlen=E2E_SAMPLES)  # simulated E2E
        #: Set by the serve app before :meth:`run` (None: nobody is told).
        self.observer: RuntimeObserver | None = None
        #: The newest :meth:`set_capacity` calls, oldest first, and how many there were.
        self.capacity_changes: deque[CapacityChange] = deque(maxlen=CAPACITY_HISTORY)
        self.capacity_change_count = 0
        #: vLLM's sleep mode (``POST /sleep``): 0 awake, else the level; admission refuses
        #: while it is set (set and cleared by the serve app).
        self.sleep_level = 0
        self._snapshot = self._make_snapshot()

    # ------------------------------------------------------------------ snapshots
    def _make_snapshot(self) -> RuntimeSnapshot:
        engine = self.engine
        admission = self._admission
        alive = self._alive
        waiting = engine.num_waiting() if alive else 0
        pending = admission.pending
        if admission.max_waiting:
            depth = admission.depth()
        else:  # nothing to decide: an O(replicas) estimate, no walk of the queue
            depth = max(0, waiting + pending - engine.free_seqs())
        return RuntimeSnapshot(
            model=self.name,
            alive=alive,
            waiting=waiting,
            pending=pending,
            depth=depth if alive else 0,
            running=engine.num_running() if alive else 0,
            max_num_seqs=engine.max_num_seqs,
            max_waiting=admission.max_waiting,
            admitted=self._admitted,
            refused=self._refused,
            aborted=self._aborted,
            events=self._lag.count,
            lag_max=self._lag.max,
            lag_mean=self._lag.mean,
        )

    def _publish(self) -> None:
        self._snapshot = self._make_snapshot()

    def snapshot(self) -> RuntimeSnapshot:
        """The latest published snapshot (no work: a field read)."""
        return self._snapshot

    def calibration(self) -> PacingCalibration:
        """What the pacer has learned of this machine's timer lateness (Rule 2)."""
        return self._wake.statistics()

    def adopt_calibration(self, calibration: PacingCalibration) -> None:
        """Start from ``calibration`` (another runtime's on the same machine, e.g. a
        warm-up's) instead of from nothing: a fresh runtime's first wake-ups are then
        on time as well. Learning goes on from there; nothing else changes."""
        self._wake.adopt(calibration)

    def statistics(self, last: int | None = None, finished: int | None = None) -> RuntimeStatistics:
        """A fuller picture (costlier than :meth:`snapshot`). Pacing-lag percentiles are
        over the ``last`` recorded events, the median simulated E2E (arrival to finish, in
        engine time) over the ``finished`` last completions (default: whole windows)."""
        e2e = np.fromiter(self._e2e_samples, dtype=np.float64)
        if finished is not None:
            e2e = e2e[-finished:] if finished > 0 else e2e[:0]
        return RuntimeStatistics(
            snapshot=self._snapshot,
            engine=self.engine.statistics(),
            sim_time=self.engine.now,
            wall_time=trio.current_time() - self.epoch if self._started else 0.0,
            lag=self._lag.statistics(last),
            precise_timer=self._precise,
            calibration=self.calibration(),
            e2e_count=int(e2e.size),
            e2e_p50=float(np.median(e2e)) if e2e.size else 0.0,
        )

    def pacing_lag(self) -> float:
        """How late this model's engine is now (seconds, >= 0), for the header every
        generation answer carries: 0 while it has no event ahead (idle, or not running);
        else the larger of how overdue its next event already is and the lag of its latest
        wake-up that handled events (lag Rule 5). O(1), no allocation; called by the serve
        layer when a request reaches admission."""
        t = self.engine.next_event_time() if self._alive else None
        if t is None:
            return 0.0
        overdue = trio.current_time() - (self.epoch + t)
        latest = self._lag.latest
        return overdue if overdue > latest else latest

    def recent_lag_p99(self) -> float:
        """The pacing lag's p99 over the last complete second, 0 after a quiet second
        (lag Rule 5); read by the dashboard's sampler."""
        return self._lag.recent_p99(trio.current_time())

    # ------------------------------------------------------------------ HTTP side
    def check_fits(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> RequestRefused | None:
        """Why a request of this size (``n`` sequences) can never run on this model, or
        None (pure)."""
        return self.engine.check_fits(prompt_tokens, max_tokens, n)

    def admit_nowait(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        sink: RequestSink,
        arrival: float | None = None,
        n: int = 1,
        limit: int | None = None,
        block_hashes: tuple[int, ...] = (),
        drawn: bool = True,
        min_length: int = 0,
        model: str | None = None,
        hold_kv: bool = False,
        remote_positions: int = 0,
    ) -> RequestHandle:
        """The single entry into the engine. Synchronous, no checkpoint.

        Raises :class:`EngineUnavailable` when the engine task is not running, then
        :class:`QueueFull` when the request has neither a seat nor a waiting place
        (:mod:`inference_lab.core.admission`). Otherwise routes it, stamps the arrival (``arrival``, the trio
        time at which the server received the request, or now), draws the response length
        (``--workload``; at most ``limit``, where a stop string ends the output, and
        ``max_tokens``) and queues the arrival of its ``n`` sequences for the engine task.
        ``block_hashes`` (its prompt's and answer's hash chain, :mod:`inference_lab.api.hashing`)
        go with it, so the router and the prefix cache see them.
        With ``drawn`` False the answer's content decides its length (a JSON document of
        ``limit`` tokens, or a request that runs to its cap): no length is drawn for it.
        A drawn length is at least ``min_length`` (vLLM's ``min_tokens``), within the cap.
        ``model``, the name the request gave, runs it with that LoRA adapter when it is not
        this model's own name (the caller checked the engine serves it).
        ``hold_kv`` and ``remote_positions`` are a prefill server's and a decode server's
        parts of a hand-off (Rule 10; ``remote_positions`` needs ``n`` 1 and fewer
        positions than the prompt).
        """
        if not self._alive:
            if self.observer is not None:
                self.observer.on_refused("engine_unavailable")
            raise EngineUnavailable(self.name)
        if self.sleep_level:
            if self.observer is not None:
                self.observer.on_refused("engine_sleeping")
            raise EngineSleeping(self.name)
        asked = RequestSpec(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            n=n,
            block_hashes=block_hashes,
            remote_positions=remote_positions,
        )
        handle = RequestHandle(runtime=self, spec=asked, sink=sink)
        claim = self._admission.admit(handle, asked)
        if claim is None:
            self._refused += 1
            self._publish()
            if self.observer is not None:
                self.observer.on_refused("queue_saturated")
            raise QueueFull(
                self.name, self._snapshot.depth, self._admission.max_waiting, self.retry_after()
            )
        cap = max_tokens if limit is None else min(limit, max_tokens)
        target = cap if cap < max_tokens else None
        if self._output_lengths is not None and drawn:
            sample = int(self._output_lengths.sample(self._rng, 1)[0])
            target = max(1, min(max(sample, min_length), cap))
        handle.spec = RequestSpec(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            target=target,
            priority=priority,
            n=n,
            arrival_time=(trio.current_time() if arrival is None else arrival) - self.epoch,
            worker=claim.worker,
            block_hashes=block_hashes,
            lora=None if model is None or model == self.name else model,
            hold_kv=hold_kv,
            remote_positions=remote_positions,
        )
        try:
            self._inbox_send.send_nowait(_Arrival(handle))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            handle.state = "failed"
            self._release_slot(handle)
            self._publish()
            if self.observer is not None:
                self.observer.on_refused("engine_unavailable")
            raise EngineUnavailable(self.name) from None
        self._live[handle] = None
        self._admitted += 1
        self._publish()
        return handle

    def set_capacity(
        self, *, max_num_seqs: int | None = None, max_waiting: int | None = None
    ) -> None:
        """Retune the live model (``docs/saturation.md``): ``max_num_seqs`` gates admission at
        the engine's next step (lowering drains, never evicts); ``max_waiting`` applies to
        arrivals from now on (0 = never refuse). Values are validated by the caller."""
        if max_num_seqs is not None:
            self.engine.set_max_num_seqs(max_num_seqs)
            self._admission.changed()
        if max_waiting is not None:
            self._admission.set_max_waiting(max_waiting)
        self._publish()
        snap = self._snapshot
        self.capacity_changes.append(
            CapacityChange(
                time=trio.current_time(),
                max_num_seqs=snap.max_num_seqs,
                max_waiting=snap.max_waiting,
            )
        )
        self.capacity_change_count += 1

    @property
    def live(self) -> int:
        """Requests admitted and not yet done."""
        return len(self._live)

    def abort_live(self, message: str) -> int:
        """End every live request as a failure with ``message`` (its stream ends with an
        error frame, a non-streaming request gets an error): vLLM's sleep in its ``abort``
        mode. Synchronous; returns how many it ended."""
        live = [handle for handle in self._live if not handle.done]
        for handle in live:
            handle.close()
            handle.sink.on_failed(message)
        return len(live)

    def pending_by_worker(self) -> list[int]:
        """The admitted requests not yet in a waiting queue, by the worker admission chose
        for each (with the workers' queues, ``/metrics``' per-engine waiting count)."""
        counts = [0] * self.deployment.workers
        for handle in self._live:
            if handle.holds_slot:
                counts[handle.spec.worker or 0] += 1
        return counts

    def release_kv(self, request_id: int) -> bool:
        """Give back the blocks the finished request ``request_id`` (an engine id) held
        for a remote decode (Rule 10): the engine task does it next, in order with the
        arrivals. Synchronous; False when the engine is not running (nothing is held)."""
        if not self._alive:
            return False
        try:
            self._inbox_send.send_nowait(_Release(request_id))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's ``reset_prefix_cache``): only when no running
        request holds one; returns whether it was done."""
        done = self.engine.reset_prefix_cache()
        if done:
            self._admission.changed()
            self._publish()
        return done

    def retry_after(self) -> int:
        """A refusal's ``Retry-After``: whole seconds, 1 to :data:`RETRY_AFTER_MAX`, until
        one waiting place is expected to free -- when the first running request finishes
        (a seat frees, the head of the queue takes it), at the engine's current step
        times (:meth:`Engine.time_to_next_finish`)."""
        now = trio.current_time() - self.epoch if self._started else self.engine.now
        eta = self.engine.time_to_next_finish(now)
        if eta is None:
            return 1
        return max(1, min(RETRY_AFTER_MAX, math.ceil(eta)))

    def _release_slot(self, handle: RequestHandle) -> None:
        if handle.holds_slot:
            handle.holds_slot = False
            self._admission.release(handle)

    def _close(self, handle: RequestHandle, withdrawn: bool = False) -> None:
        """Abort ``handle`` if it is still live (idempotent; called by RequestHandle);
        ``withdrawn``: undo its admission instead (:meth:`RequestHandle.withdraw`)."""
        if handle.done:
            return
        handle.state = "aborted"
        self._live.pop(handle, None)
        self._release_slot(handle)
        if withdrawn:
            self._admitted -= 1
        else:
            self._aborted += 1
            if self.observer is not None:
                self.observer.on_aborted(handle.spec.worker or 0)
        rid = handle.request_id
        if rid is not None:
            self._by_id.pop(rid, None)
            if self._alive:
                self._admission.changed()
                try:
                    self.engine.abort(rid)
                except Exception as exc:  # noqa: BLE001 - an engine failure stops the model
                    self._fail(exc)
                    return
        self._publish()

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine and pacer tasks until :meth:`stop` or an engine failure.

        Simulated time 0 is the moment this starts (the epoch). Never raises for an
        engine failure (other models keep serving); cancellation propagates.
        """
        if self._started:
            raise RuntimeError(f"the runtime of {self.name} has already run")
        self._started = True
        self.epoch = trio.current_time()
        self._lag.start(self.epoch)
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._engine_task)
                nursery.start_soon(self._pacer_task)
                self._alive = True
                self._publish()
                task_status.started()
        finally:
            self._shut_down(f"The engine for model '{self.name}' stopped.")
            self._stopped.set()

    def stop(self) -> None:
        """Stop the model: refuse new requests (503) and end the runtime's tasks.
        Requests still live are told ``on_failed``. Synchronous and idempotent."""
        self._shut_down(f"The engine for model '{self.name}' stopped.")
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def kill(self) -> None:
        """Fail the model as an engine crash does (Rule 7): new requests get 503, the
        snapshot says it is not alive, every live request is told ``on_failed`` with the
        crash's message and the runtime's tasks end. For the test harness
        (``POST /control/engine``); synchronous, and a no-op unless the model is alive."""
        if self._alive:
            self._fail(EngineKilled("the engine was killed on request (test harness)"))

    def set_step_time_factor(self, factor: float) -> None:
        """Price every engine step that starts from now on at ``factor`` x its roofline
        time (the test harness's slowdown; 1.0 restores). The step in flight keeps its
        end time. ``factor`` (> 0, finite) is validated by the caller."""
        self.engine.set_step_time_factor(factor)

    async def wait_stopped(self) -> None:
        if self._started:
            await self._stopped.wait()

    def _shut_down(self, message: str) -> None:
        was_alive = self._alive
        self._alive = False
        self._inbox_recv.close()
        live = list(self._live)
        self._live.clear()
        self._by_id.clear()
        for handle in live:
            handle.state = "failed"
            self._release_slot(handle)
        self._admission.clear()
        self._publish()
        self._taken.unpark_all()
        for handle in live:
            handle.sink.on_failed(message)
        if was_alive and live:
            logger.info("%s: %d live requests ended: %s", self.name, len(live), message)

    def _fail(self, exc: BaseException) -> None:
        logger.error("engine of model %s failed", self.name, exc_info=exc)
        self._shut_down(f"The engine for model '{self.name}' failed: {type(exc).__name__}: {exc}")
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    # ------------------------------------------------------------------ engine task
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
            if events.tokens or events.finished:  # Rule 2: what a client sees
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

    # ------------------------------------------------------------------ pacer task
    async def _pacer_task(self) -> None:
        """Sleep until ``epoch + deadline`` of the engine's next event, then tell the
        engine task. A newer deadline replaces the one being slept on: the engine task
        cancels the sleep (:meth:`_send_deadline`), which only happens when the next
        event moved while a step was in flight (an arrival is handled at once, so it
        does not move the step's end)."""
        deadlines = self._deadline_recv
        deadline: float | None = None
        timer = Timer()
        self._precise = timer.precise
        try:
            while True:
                while True:  # the newest deadline sent wins
                    try:
                        deadline = deadlines.receive_nowait()
                    except trio.WouldBlock:
                        break
                if deadline is None:
                    deadline = await deadlines.receive()
                    continue
                with trio.CancelScope() as scope:
                    self._sleep_scope = scope
                    await timer.sleep_until(self.epoch + deadline - self._wake.early)
                self._sleep_scope = None
                if scope.cancelled_caught:
                    continue
                deadline = None
                try:
                    self._inbox_send.send_nowait(_TICK)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        finally:
            self._sleep_scope = None
            timer.close()
