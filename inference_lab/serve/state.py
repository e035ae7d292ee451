"""The serving state of one app: its models' runtimes and the stream delivery.

Rule 1: one :class:`ServeState` per app object; :meth:`ServeState.start` runs once, in the
        app's serving lifespan, and :meth:`ServeState.stop` ends every task it started, so
        nothing outlives the app's background nursery.
Rule 2: the runtimes are built (engines constructed, configs resolved) before serving
        starts; serving only starts their tasks.
"""

from __future__ import annotations

import gc
import time

import attrs
import trio

from inference_lab.errors import ApiError, truncate_echo
from inference_lab.runtime import ModelRuntime
from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.streaming import Delivery
from inference_lab.workload import make_rng

__all__ = ["GC_THRESHOLDS", "ServeState"]

#: The garbage collector's thresholds in a server process (``gc.set_threshold``). At 256
#: streams the defaults (700, 10, 10) ran ~1600 young, 150 middle and 13 full collections
#: in 9 s, 0.9 s of CPU; these run about one young collection a second (~8 ms each).
GC_THRESHOLDS = (10_000, 20, 20)


@attrs.define(kw_only=True)
class ServeState:
    """The models one app serves, in load order, and when the app was created."""

    settings: ServeSettings
    runtimes: dict[str, ModelRuntime]
    created: int
    delivery: Delivery = attrs.field(factory=Delivery)
    #: This app is a whole server process: warm the code paths and tune the garbage
    #: collector when serving starts (tests' apps share their process and skip both).
    server_process: bool = False

    @classmethod
    def build(cls, settings: ServeSettings, *, server_process: bool = False) -> ServeState:
        runtimes: dict[str, ModelRuntime] = {}
        for dep in settings.deployments:
            workload = settings.workload
            runtimes[dep.model.name] = ModelRuntime(
                dep,
                output_lengths=workload.output_len_dist if workload is not None else None,
                rng=make_rng(workload, settings.seed) if workload is not None else None,
            )
        return cls(
            settings=settings,
            runtimes=runtimes,
            created=int(time.time()),
            server_process=server_process,
        )

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the delivery task and every model's runtime in ``nursery`` (after a
        warm-up, in a server process)."""
        if self.server_process:
            from inference_lab.serve.warmup import warm_up  # it builds ServeStates itself

            await warm_up(self.settings)
            # Everything loaded so far (modules, configs, engines) lives as long as the
            # process: freezing it keeps the rare full garbage collections short (they
            # otherwise stall the pacer for ~40 ms on this stack).
            gc.freeze()
            # Almost everything a request allocates dies by reference counting; with the
            # default threshold (700) the young-generation collections that keep finding
            # nothing cost ~10 % of the CPU at 256 streams (see GC_THRESHOLDS).
            gc.set_threshold(*GC_THRESHOLDS)
        await nursery.start(self.delivery.run)
        for runtime in self.runtimes.values():
            await nursery.start(runtime.run)

    async def stop(self) -> None:
        """Stop every runtime (live requests are told the engine stopped) and the
        delivery task; return once the runtimes' tasks have ended."""
        self.delivery.stop()
        for runtime in self.runtimes.values():
            runtime.stop()
        for runtime in self.runtimes.values():
            await runtime.wait_stopped()

    def model_not_found(self, model: str) -> ApiError:
        """The 404 for a request naming a model this app does not serve."""
        available = ", ".join(self.runtimes)
        return ApiError(
            404,
            "model_not_found",
            f"Model '{truncate_echo(model)}' not found. Available models: {available}",
            "model",
        )
