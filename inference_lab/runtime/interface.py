"""What the serve layer and a :class:`~inference_lab.runtime.model_runtime.ModelRuntime`
hand each other: the sinks and observer the runtime calls, the snapshots and statistics
it publishes, and the :class:`RequestHandle` of an admitted request.

The rules are ``model_runtime.py``'s; every name here is importable from there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import attrs
import numpy as np
import trio

from inference_lab.core.engine import EngineStatistics, Finished, KVEvent, RequestSpec, StepEvents
from inference_lab.runtime.calibration import PacingCalibration
from inference_lab.runtime.lag import LagStatistics

__all__ = [
    "CapacityChange",
    "KVEventSink",
    "LengthSampler",
    "RequestHandle",
    "RequestSink",
    "RuntimeOfHandle",
    "RuntimeObserver",
    "RuntimeSnapshot",
    "RuntimeStatistics",
]


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
    pacing lag (None for a step that released no token and ended no request:
    model_runtime Rule 2); ``on_finished_request`` for each request a step finished, with the
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
    #: lag is recorded, model_runtime Rule 2).
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


class RuntimeOfHandle(Protocol):
    """What a :class:`RequestHandle` asks of the runtime that admitted it (a
    :class:`~inference_lab.runtime.model_runtime.ModelRuntime`)."""

    #: Woken when the engine task has taken arrivals (:meth:`RequestHandle.wait_taken`).
    _taken: trio.lowlevel.ParkingLot
    #: The handles admitted and not yet done.
    _live: dict[RequestHandle, None]

    def _close(self, handle: RequestHandle, withdrawn: bool = False) -> None: ...


@attrs.define(eq=False, kw_only=True)
class RequestHandle:
    """One admitted request, owned by the HTTP handler that admitted it.

    :meth:`close` is the one cleanup call: synchronous and idempotent; it aborts the
    request in the engine unless it already finished or failed.
    """

    runtime: RuntimeOfHandle
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
