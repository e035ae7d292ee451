"""The serving state of one app: its models' runtimes and the stream delivery.

Rule 1: one :class:`ServeState` per app object; :meth:`ServeState.start` runs once, in the
        app's serving lifespan, and :meth:`ServeState.stop` ends every task it started, so
        nothing outlives the app's background nursery.
Rule 2: the runtimes are built (engines constructed, configs resolved) before serving
        starts; serving only starts their tasks.
Rule 3: a shutdown (:meth:`ServeState.drain`) first stops admitting (``draining``: every
        new request is a 503), lets live requests run for the grace period, then stops
        the runtimes with ``shutdown_message`` set, so each request still live ends with
        an answer naming the shutdown; only then may the HTTP server cancel connections.
Rule 4: a restart (the test harness: :meth:`ServeState.restart_runtime`) stops one model's
        runtime and starts a fresh one in the same nursery, so :meth:`ServeState.stop`
        still ends it; the model's metrics carry over.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import trio

from inference_lab.core.config import Deployment
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime.model import ModelRuntime
from inference_lab.serve.harness.intercept import Harness
from inference_lab.serve.metrics import ServeMetrics
from inference_lab.serve.response_store import ResponseStore
from inference_lab.serve.responses import SHUTDOWN_MESSAGE
from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.streaming import Delivery

__all__ = ["ServeState"]

#: Seconds between two looks at the live requests while a shutdown drains.
DRAIN_POLL = 0.02


@attrs.define(kw_only=True)
class ServeState:
    """The models one app serves, in load order, and when the app was created."""

    settings: ServeSettings
    runtimes: dict[str, ModelRuntime]
    created: int
    #: The runtimes' observers and the registry of ``GET /metrics``.
    metrics: ServeMetrics
    delivery: Delivery = attrs.field(factory=Delivery)
    #: A shutdown has begun: new requests are refused (503, ``Connection: close``).
    draining: bool = False
    #: Set when a shutdown stopped the runtimes: the message live requests end with.
    shutdown_message: str | None = None
    #: Set to end a shutdown's grace period early (a second signal).
    _hurry: trio.Event = attrs.field(factory=trio.Event, init=False)
    #: The test harness (fault injection, scripted answers, engine control).
    harness: Harness = attrs.field(factory=lambda: Harness(enabled=False))
    #: Stored ``/v1/responses`` answers (``store``, ``previous_response_id``).
    responses: ResponseStore = attrs.field(factory=ResponseStore)
    #: The nursery the runtimes run in (set by :meth:`start`; a restart starts one there).
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)

    @classmethod
    def build(cls, settings: ServeSettings) -> ServeState:
        runtimes: dict[str, ModelRuntime] = {}
        for dep in settings.deployments:
            runtimes[dep.model.name] = cls._new_runtime(settings, dep)
        return cls(
            settings=settings,
            runtimes=runtimes,
            created=int(time.time()),
            metrics=ServeMetrics(runtimes),
            harness=Harness(
                enabled=settings.enable_test_harness,
                faults=settings.faults,
                seed=settings.seed or 0,
            ),
        )

    @staticmethod
    def _new_runtime(settings: ServeSettings, dep: Deployment) -> ModelRuntime:
        workload = settings.workload
        return ModelRuntime(
            dep,
            output_lengths=workload.output_len_dist if workload is not None else None,
            rng=np.random.default_rng(workload.seed if settings.seed is None else settings.seed)
            if workload is not None
            else None,
        )

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the delivery task and every model's runtime in ``nursery``."""
        self._nursery = nursery
        await nursery.start(self.delivery.run)
        for runtime in self.runtimes.values():
            await nursery.start(runtime.run)

    async def restart_runtime(self, name: str) -> ModelRuntime:
        """Replace model ``name``'s runtime by a fresh one (a new engine: capacity and
        step prices as configured) started in the app's nursery; the old one is stopped
        first (its live requests are told it stopped). Returns the new runtime. For the
        test harness's ``POST /control/engine`` (``restart``)."""
        if self._nursery is None:
            raise RuntimeError("the app is not serving")
        old = self.runtimes[name]
        old.stop()
        await old.wait_stopped()
        fresh = self._new_runtime(self.settings, old.deployment)
        fresh.adopt_calibration(old.calibration())  # the machine did not change
        metrics = self.metrics.models.get(name)
        if metrics is not None:  # the model's counters go on across restarts
            metrics.runtime = fresh
            fresh.observer = metrics
        await self._nursery.start(fresh.run)
        self.runtimes[name] = fresh
        return fresh

    async def stop(self) -> None:
        """Stop every runtime (live requests are told the engine stopped) and the
        delivery task; return once the runtimes' tasks have ended."""
        self.delivery.stop()
        for runtime in self.runtimes.values():
            runtime.stop()
        for runtime in self.runtimes.values():
            await runtime.wait_stopped()

    def live_requests(self) -> int:
        """Requests admitted and not yet ended, plus streams still being written."""
        live = self.delivery.open
        for runtime in self.runtimes.values():
            snap = runtime.snapshot()
            live += snap.queued + snap.running
        return live

    def hurry(self) -> None:
        """End the grace period of a shutdown now (or the next one at once)."""
        self._hurry.set()

    async def drain(self, grace: float) -> int:
        """The shutdown sequence (Rule 3): stop admitting; wait until no request is live,
        :meth:`hurry` is called or ``grace`` seconds have passed; then stop the runtimes,
        every live request ending with :data:`SHUTDOWN_MESSAGE`. Returns how many requests
        the shutdown ended. Called by the serving loop before it stops the HTTP server."""
        self.draining = True
        deadline = trio.current_time() + grace
        while self.live_requests() and not self._hurry.is_set():
            now = trio.current_time()
            if now >= deadline:
                break
            # The runtimes publish no "idle" event: look again every DRAIN_POLL seconds.
            with trio.move_on_at(min(deadline, now + DRAIN_POLL)):
                await self._hurry.wait()
        ended = sum(rt.snapshot().queued + rt.snapshot().running for rt in self.runtimes.values())
        self.shutdown_message = SHUTDOWN_MESSAGE
        await self.stop()
        return ended

    def model_not_found(self, model: str) -> ApiError:
        """The 404 for a request naming a model this app does not serve."""
        available = ", ".join(self.runtimes)
        return ApiError(
            404,
            "model_not_found",
            f"Model '{truncate_echo(model)}' not found. Available models: {available}",
            "model",
        )
