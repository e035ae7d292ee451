"""``create_app``: the serve app, for ``inference-lab serve`` and a plain hypercorn launch.

``inference-lab serve`` runs it under hypercorn's trio worker on a socket it binds itself,
and ``hypercorn --worker-class trio 'inference_lab.serve:create_app()'`` runs it configured
from the environment (``INFERENCE_LAB_*``). Either way the per-model runtimes start in the
app's own serving lifespan, so both launches serve the same API.

Rule 1: one app object serves once (its runtimes run once); create a fresh app per server,
        tests included.
Rule 2: this is the composition root: in a whole server process, serving starts with the
        warm-up (:mod:`inference_lab.serve.warmup`, on a throwaway state) and the garbage
        collector's tuning, then the runtimes; tests' apps share their process and skip both.
Rule 3: a worker process of a plain hypercorn launch ends when hypercorn's parent
        process dies (``PR_SET_PDEATHSIG``, Linux), so a ``kill -9`` of the parent leaves
        no orphan serving on the port and holding it.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import sys

import attrs

from inference_lab.api.requests import MAX_BODY_BYTES
from inference_lab.errors import ConfigError
from inference_lab.serve.agent_routes import register_response_routes
from inference_lab.serve.asgi import STATE_KEY, InferenceLabApp
from inference_lab.serve.dashboard import Sampler, register_dashboard_routes
from inference_lab.serve.harness.control import register_harness_routes
from inference_lab.serve.health import HEALTH_PATH
from inference_lab.serve.kv_routes import admission_target, register_kv_routes
from inference_lab.serve.launch import fail_launch
from inference_lab.serve.ops import register_ops_routes
from inference_lab.serve.routes import register_routes
from inference_lab.serve.settings import ServeSettings, startup_warnings
from inference_lab.serve.settings_env import settings_from_env
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import install_connection_hook
from inference_lab.serve.warmup import warm_up

__all__ = ["GC_THRESHOLDS", "SAMPLER_KEY", "create_app"]

#: Where an app keeps its dashboard :class:`Sampler` (None with the dashboard off).
SAMPLER_KEY = "inference_lab.dashboard"

#: The garbage collector's thresholds in a server process (``gc.set_threshold``). A young
#: collection walks what is alive of the young objects -- with hundreds of streams, tens of
#: thousands (suspended coroutines of the stream tasks, their cancel scopes, tuples) -- so
#: its cost is per collection, and a stall of the loop each; what a request allocates dies
#: by reference counting, so collections are made rare.
GC_THRESHOLDS = (50_000, 20, 20)


#: ``prctl`` option: the signal the kernel sends this process when its parent dies.
PR_SET_PDEATHSIG = 1


def exit_with_parent() -> bool:
    """In a worker process that a parent spawned (hypercorn's workers: a multiprocessing
    child), ask the kernel for SIGTERM when the parent dies (Rule 3); if it died already,
    end now. True when the request was made. Linux only; elsewhere nothing happens."""
    if sys.platform != "linux" or multiprocessing.parent_process() is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent is gone already
        os.kill(os.getpid(), signal.SIGTERM)
    return True


async def _prepare_process(state: ServeState) -> None:
    """Warm the completion path on a throwaway state (its runtimes' pacing calibration is
    handed to the served ones), then freeze everything loaded so far (it lives as long as
    the process: the rare full collections stay short) and raise the thresholds."""
    # (without [fault] tables: a warm-up stream must not stall or be cut; without KV
    # events: the served state's publishers hold the sockets)
    learned = await warm_up(attrs.evolve(state.settings, faults=(), kv_events=None))
    for name, calibration in learned.items():
        state.runtimes[name].adopt_calibration(calibration)
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _settings_of_launch() -> ServeSettings:
    """A plain hypercorn launch's settings, from the environment: a bad one ends the
    process with one line (serve/launch.py); the start-up warnings go to stderr."""
    exit_with_parent()
    try:
        settings = settings_from_env()
    except ConfigError as exc:
        fail_launch(str(exc))
    for line in startup_warnings(settings):
        print(f"inference-lab: warning: {line}", file=sys.stderr)
    return settings


def create_app(
    settings: ServeSettings | None = None, *, server_process: bool | None = None
) -> InferenceLabApp:
    """The serve app. With ``settings`` None it is configured from the environment
    (:func:`settings_from_env`), for ``hypercorn 'inference_lab.serve:create_app()'``.

    Raises ConfigError when a KV-events socket cannot be used (an environment-configured
    app ends its process with that one line instead).

    ``server_process`` (default: only for an environment-configured app, i.e. a whole
    server process) warms the completion path when serving starts
    (:mod:`inference_lab.serve.warmup`), then freezes the objects loaded so far and raises
    the collector's thresholds (:data:`GC_THRESHOLDS`) (Rule 2).
    """
    if server_process is None:
        server_process = settings is None
    settings_given = settings is not None
    if settings is None:
        settings = _settings_of_launch()
    install_connection_hook()  # the transport's hooks: arrival stamps, close watch, writes
    app = InferenceLabApp(__name__)
    # OPTIONS is answered by the gate (CORS preflights from allowed origins) or is a 405,
    # not Quart's automatic 200 (set before any route is registered).
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    try:
        state = ServeState.build(settings)  # binds the KV-event sockets, if any
    except ConfigError as exc:
        if not server_process or settings_given:
            raise
        fail_launch(str(exc))
    app.extensions[STATE_KEY] = state
    # the connection answers GET /health and each model's admission probe itself
    app.quick_paths = frozenset(
        {HEALTH_PATH.encode(), *(admission_target(name).encode() for name in state.runtimes)}
    )
    # The live dashboard's sampler (serve/dashboard.py), one per app; off: no routes.
    sampler = Sampler(state) if settings.dashboard else None
    app.extensions[SAMPLER_KEY] = sampler
    if sampler is not None:
        state.stop_hooks.append(sampler.stop)  # after the runtimes: streams end with them

    @app.before_serving
    async def _start_runtimes() -> None:
        if server_process:
            await _prepare_process(state)
        await state.start(app.nursery)
        if sampler is not None:
            await app.nursery.start(sampler.run)

    @app.after_serving
    async def _stop_runtimes() -> None:
        # hypercorn cancels the app's background nursery right after this returns:
        # stop the runtimes here and wait for them, so nothing is cut mid-step.
        await state.stop()

    register_routes(app, state)
    if sampler is not None:
        register_dashboard_routes(app, sampler)
    register_response_routes(app, state)  # GET / DELETE /v1/responses/{id}
    register_ops_routes(app, state)  # /ping, /load, /reset_prefix_cache, sleep mode
    register_harness_routes(app, state)  # POST /control/engine, harness on only
    register_kv_routes(app, state)  # /kv_transfer/*: prefill/decode hand-offs
    return app
