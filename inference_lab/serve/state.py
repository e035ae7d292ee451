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
        still ends it; the model's metrics carry over, and its KV-event subscribers are
        told every block was cleared (the fresh engine's cache is empty).
Rule 5: a model whose deployment caches prefixes has a
        :class:`~inference_lab.api.hashing.PromptHashing` (``hashing``): its requests are
        hashed when parsed. With ``--kv-events-endpoint`` its runtime's KV-cache events go
        to its publisher (:mod:`inference_lab.serve.kv_events`), whose sockets are bound
        when the state is built and whose thread runs while the runtimes do.
Rule 6: each model's runtime draws prose answer lengths from one generator of its own,
        seeded by ``--seed`` (else the workload's seed, else 0) plus the server's
        data-parallel rank (``serve/ranks.py``: ranks are not clones): the workload's
        ``output_len_dist``, else the default length model, none with
        ``run_to_max_tokens``.
Rule 7: the app's prefill/decode part (``--role``: :class:`KVConnector`) is built with the
        state and its background task (a prefill server's expiry of held KV, a decode
        server's releases) runs from :meth:`ServeState.start` to :meth:`ServeState.stop`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import trio

from inference_lab.api.hashing import PromptHashing
from inference_lab.api.lengths import DEFAULT_ANSWER_LENGTHS
from inference_lab.api.requests import ParsedRequest
from inference_lab.core.config import Deployment, LengthDist
from inference_lab.core.engine import AllBlocksCleared
from inference_lab.core.engine.lora import adapter_hashes
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.error_replies import SHUTDOWN_MESSAGE
from inference_lab.serve.harness.intercept import Harness
from inference_lab.serve.kv_events import KVEventsHub
from inference_lab.serve.kv_metrics import kv_families
from inference_lab.serve.kv_transfer import KVConnector
from inference_lab.serve.metrics import ServeMetrics
from inference_lab.serve.response_store import ResponseStore
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
    #: Called by :meth:`stop` once the runtimes have ended (synchronous, idempotent): the
    #: dashboard's sampler, whose event streams then end before the connections are cut.
    stop_hooks: list[Callable[[], None]] = attrs.field(factory=list)
    #: Model name -> how its requests are hashed (Rule 5); absent: not hashed.
    hashing: dict[str, PromptHashing] = attrs.field(factory=dict)
    #: The KV-event publishers (``--kv-events-endpoint``; Rule 5), or None.
    kv_events: KVEventsHub | None = None
    #: Prefill/decode hand-offs by ``--role`` (``serve/kv_transfer.py``; Rule 7).
    kv: KVConnector = attrs.field(
        default=attrs.Factory(
            lambda self: KVConnector(self.settings, self.runtimes), takes_self=True
        )
    )
    #: The cancel scope of the hand-offs' background task (set by :meth:`start`).
    _kv_scope: trio.CancelScope | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        kv, runtimes = self.kv, self.runtimes
        self.metrics.extra.append(lambda: kv_families(kv, runtimes))

    @classmethod
    def build(cls, settings: ServeSettings) -> ServeState:
        """The state of a new app. Raises ConfigError when a KV-events socket cannot be
        bound (or pyzmq is missing)."""
        hub = (
            KVEventsHub(
                settings.kv_events,
                settings.deployments,
                rank=settings.data_parallel_rank,
                ranks=settings.data_parallel_size,
            )
            if settings.kv_events is not None
            else None
        )
        runtimes: dict[str, ModelRuntime] = {}
        hashing: dict[str, PromptHashing] = {}
        for dep in settings.deployments:
            runtimes[dep.model.name] = cls._new_runtime(settings, dep, hub)
            if dep.scheduler.enable_prefix_caching:
                hashing[dep.model.name] = PromptHashing(
                    block_size=dep.scheduler.block_size,
                    max_positions=dep.model.max_seq_len,
                    keep_tokens=hub is not None,
                )
        return cls(
            settings=settings,
            runtimes=runtimes,
            created=int(time.time()),
            metrics=ServeMetrics(
                runtimes,
                fine_buckets=settings.fine_latency_buckets,
                rank=settings.data_parallel_rank,
            ),
            harness=Harness(
                enabled=settings.enable_test_harness,
                faults=settings.faults,
                seed=(settings.seed or 0) + settings.data_parallel_rank,
            ),
            hashing=hashing,
            kv_events=hub,
        )

    @staticmethod
    def _new_runtime(
        settings: ServeSettings, dep: Deployment, hub: KVEventsHub | None = None
    ) -> ModelRuntime:
        """A model's runtime; prose answers draw their length from the workload's
        ``output_len_dist``, else from the default length model (``api/lengths.py``),
        unless ``run_to_max_tokens`` (Rule 6)."""
        workload = settings.workload
        lengths: LengthDist | None = None
        seed = settings.seed if settings.seed is not None else 0
        if workload is not None:
            lengths = workload.output_len_dist
            seed = workload.seed if settings.seed is None else settings.seed
        elif not settings.run_to_max_tokens:
            lengths = DEFAULT_ANSWER_LENGTHS
        return ModelRuntime(
            dep,
            output_lengths=lengths,
            rng=np.random.default_rng(seed + settings.data_parallel_rank)
            if lengths is not None
            else None,
            kv_events=hub.sink(dep.model.name) if hub is not None else None,
        )

    def remember_tokens(self, parsed: ParsedRequest) -> None:
        """Keep an admitted request's hashed stream for its model's KV-event publisher
        (the token ids of the blocks it stores); nothing without one. An adapter's blocks
        are named by its own hashes (the engine's lora Rule 4)."""
        if self.kv_events is not None:
            base = self.base_of(parsed.model)
            publisher = self.kv_events.publishers.get(base)
            if publisher is not None:
                hashes = parsed.block_hashes
                if base != parsed.model:
                    hashes = adapter_hashes(hashes, parsed.model)
                publisher.remember(hashes, parsed.hashed_tokens)

    def runtime_for(self, model: str) -> ModelRuntime | None:
        """The runtime a request's ``model`` runs on: the model's, or that of the model
        serving the LoRA adapter of that name (serve/lora.py Rule 3); None: neither."""
        runtime = self.runtimes.get(model)
        if runtime is not None:
            return runtime
        for rt in self.runtimes.values():
            adapters = rt.engine.adapters
            if adapters is not None and model in adapters.by_name:
                return rt
        return None

    def base_of(self, model: str) -> str:
        """The model a name runs on: itself, or an adapter's base model."""
        runtime = self.runtime_for(model)
        return model if runtime is None else runtime.name

    def counted_as(self, model: Any) -> Any:
        """The model whose tokenizer and prefix rule count a request body naming ``model``
        (any JSON value: validation refuses a non-string): itself, or a LoRA adapter's base
        model (serve/lora.py Rule 3)."""
        if type(model) is str and model not in self.runtimes:
            return self.base_of(model)
        return model

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the delivery task, the KV-event publishers and every model's runtime in
        ``nursery``."""
        self._nursery = nursery
        await nursery.start(self.delivery.run)
        if self.kv_events is not None:
            self.kv_events.start()
        await nursery.start(self._run_kv)
        for runtime in self.runtimes.values():
            await nursery.start(runtime.run)

    async def _run_kv(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            self._kv_scope = scope
            await self.kv.run(task_status=task_status)

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
        fresh = self._new_runtime(self.settings, old.deployment, self.kv_events)
        fresh.adopt_calibration(old.calibration())  # the machine did not change
        if fresh.kv_events is not None:  # the fresh engine caches nothing (Rule 4)
            workers = old.deployment.workers
            fresh.kv_events(tuple(AllBlocksCleared(worker=w) for w in range(workers)))
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
        if self._kv_scope is not None:
            self._kv_scope.cancel()
        for runtime in self.runtimes.values():
            runtime.stop()
        for runtime in self.runtimes.values():
            await runtime.wait_stopped()
        for hook in self.stop_hooks:
            hook()
        hub, self.kv_events = self.kv_events, None
        if hub is not None:  # send what is queued, then close the sockets
            await trio.to_thread.run_sync(hub.close)

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
