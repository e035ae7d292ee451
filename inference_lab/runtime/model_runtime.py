"""The trio runtime of one served model: an engine task and a pacer task.

``docs/internals.md`` describes the runtime's shape, its pacing and its admission. The
HTTP app talks to it through three synchronous calls (:meth:`ModelRuntime.admit_nowait`,
:meth:`RequestHandle.close`, :meth:`ModelRuntime.set_capacity`) and reads
:meth:`ModelRuntime.snapshot`. What they exchange (sinks, the observer, snapshots, the
request handle) is defined in ``interface.py``; the engine task's methods, which
:class:`ModelRuntime` inherits, in ``engine_task.py``; all importable from here.

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

import numpy as np
import trio

from inference_lab.core.admission import Admission
from inference_lab.core.config import Deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.errors import EngineSleeping, EngineUnavailable, QueueFull, RequestRefused
from inference_lab.runtime.calibration import EarlyWake, PacingCalibration
from inference_lab.runtime.engine_task import (
    _TICK,
    _UNSENT,
    EngineTask,
    _Arrival,
    _Release,
    _Tick,
)
from inference_lab.runtime.interface import (
    CapacityChange,
    KVEventSink,
    LengthSampler,
    RequestHandle,
    RequestSink,
    RuntimeObserver,
    RuntimeSnapshot,
    RuntimeStatistics,
)
from inference_lab.runtime.lag import LagMeter
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

#: Simulated E2E samples kept for the median in :meth:`ModelRuntime.statistics`.
E2E_SAMPLES = 65536
#: The largest ``Retry-After`` of a refusal, in seconds.
RETRY_AFTER_MAX = 60
#: Capacity changes kept in :attr:`ModelRuntime.capacity_changes` (the newest).
CAPACITY_HISTORY = 256


class EngineKilled(Exception):
    """The failure :meth:`ModelRuntime.kill` injects: a crash on request."""


class ModelRuntime(EngineTask):
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
        session: int | None = None,
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
        positions than the prompt); ``session`` keys the ``session_affinity`` router.
        """
        if not self._alive or self.sleep_level:
            raise self._closed_refusal()
        asked = RequestSpec(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            n=n,
            block_hashes=block_hashes,
            remote_positions=remote_positions,
            session=session,
        )
        handle = RequestHandle(runtime=self, spec=asked, sink=sink)
        claim = self._admission.admit(handle, asked)
        if claim is None:
            raise self._queue_full()
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
            session=session,
        )
        try:
            self._inbox_send.send_nowait(_Arrival(handle))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._send_failed(handle) from None
        self._live[handle] = None
        self._admitted += 1
        self._publish()
        return handle

    def at_bound(self) -> bool:
        """Whether an arrival that finds no seat would be refused with a 529 now."""
        return self._alive and not self.sleep_level and self._admission.at_bound()

    def refuse_nowait(self, spec: RequestSpec) -> QueueFull | None:
        """The 529 :meth:`admit_nowait` would raise for ``spec`` (its lengths, ``n``, block
        hashes and session) now, counted and told as that one is; None when it would admit
        it or answer a 503. Nothing else changes (admission Rule 6). For answers written
        where a request is read (``serve/quick_refusal.py``)."""
        if not self.at_bound():
            return None
        return self._queue_full() if self._admission.refuses(spec) else None

    def _closed_refusal(self) -> EngineUnavailable:
        """:meth:`admit_nowait`'s refusal while the engine task is not running (503) or
        the model sleeps, told to the observer."""
        if not self._alive:
            if self.observer is not None:
                self.observer.on_refused("engine_unavailable")
            return EngineUnavailable(self.name)
        if self.observer is not None:
            self.observer.on_refused("engine_sleeping")
        return EngineSleeping(self.name)

    def _queue_full(self) -> QueueFull:
        """:meth:`admit_nowait`'s refusal when the request has neither a seat nor a waiting
        place: counted, published and told to the observer."""
        self._refused += 1
        self._publish()
        if self.observer is not None:
            self.observer.on_refused("queue_saturated")
        return QueueFull(
            self.name, self._snapshot.depth, self._admission.max_waiting, self.retry_after()
        )

    def _send_failed(self, handle: RequestHandle) -> EngineUnavailable:
        """:meth:`admit_nowait`'s refusal when the engine task's inbox closed under it:
        ``handle``'s claim goes back."""
        handle.state = "failed"
        self._release_slot(handle)
        self._publish()
        if self.observer is not None:
            self.observer.on_refused("engine_unavailable")
        return EngineUnavailable(self.name)

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
