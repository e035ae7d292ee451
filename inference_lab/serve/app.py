"""``create_app``: the serve app, for ``inference-lab serve`` and a plain hypercorn launch.

``inference-lab serve`` runs it under hypercorn's trio worker on a socket it binds itself,
and ``hypercorn --worker-class trio 'inference_lab.serve:create_app()'`` runs it configured
from the environment (``INFERENCE_LAB_*``). Either way the per-model runtimes start in the
app's own serving lifespan, so both launches serve the same API.

Rule 1: one app object serves once (its runtimes run once); create a fresh app per server,
        tests included.
"""

from __future__ import annotations

from inference_lab.api.openai import MAX_BODY_BYTES
from inference_lab.errors import ConfigError
from inference_lab.serve.asgi import STATE_KEY, InferenceLabApp
from inference_lab.serve.harness.core import register_harness_routes
from inference_lab.serve.launch import fail_launch
from inference_lab.serve.routes import register_routes
from inference_lab.serve.settings import ServeSettings, settings_from_env
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport.connection import install_receipt_hook

__all__ = ["create_app"]


def create_app(
    settings: ServeSettings | None = None, *, server_process: bool | None = None
) -> InferenceLabApp:
    """The serve app. With ``settings`` None it is configured from the environment
    (:func:`settings_from_env`), for ``hypercorn 'inference_lab.serve:create_app()'``.

    ``server_process`` (default: only for an environment-configured app, i.e. a whole
    server process) warms the completion path when serving starts
    (:mod:`inference_lab.serve.warmup`), then freezes the objects loaded so far and raises
    the collector's thresholds (:data:`inference_lab.serve.state.GC_THRESHOLDS`).
    """
    if server_process is None:
        server_process = settings is None
    if settings is None:
        try:
            settings = settings_from_env()
        except ConfigError as exc:
            # A plain hypercorn launch: one line, a non-zero exit (serve/launch.py).
            fail_launch(str(exc))
    install_receipt_hook()  # serve/connection.py: arrival stamps, single writes
    app = InferenceLabApp(__name__)
    # OPTIONS is answered by the gate (CORS preflights from allowed origins) or is a 405,
    # not Quart's automatic 200 (set before any route is registered).
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    state = ServeState.build(settings, server_process=server_process)
    app.extensions[STATE_KEY] = state

    @app.before_serving
    async def _start_runtimes() -> None:
        await state.start(app.nursery)

    @app.after_serving
    async def _stop_runtimes() -> None:
        # hypercorn cancels the app's background nursery right after this returns:
        # stop the runtimes here and wait for them, so nothing is cut mid-step.
        await state.stop()

    register_routes(app, state)
    register_harness_routes(app, state)  # POST /control/engine, harness on only
    return app
