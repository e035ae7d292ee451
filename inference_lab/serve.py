"""The Quart-Trio app of ``inference-lab serve`` (``spec/serve-api.md``, ``spec/saturation.md``).

``create_app(settings)`` builds an ordinary ASGI app: ``inference-lab serve`` runs it under
hypercorn's trio worker on a socket it binds itself, and a plain
``hypercorn --worker-class trio 'inference_lab.serve:create_app()'`` runs it configured
from the environment (``INFERENCE_LAB_*``). Either way the per-model runtimes start in the
app's own serving lifespan.

Rule 1: the HTTP layer reads only runtime snapshots and enters the engine through one
        synchronous call (``ModelRuntime.admit_nowait``); checks run in the order
        validation (400/413) -> model (404) -> fit (400) -> engine alive (503) -> depth
        (529), and every refusal is answered before any response starts.
Rule 2: errors map to HTTP here, in ``_error_response``, and nowhere else.
Rule 3: every admitted request is closed (aborted unless finished) exactly when its HTTP
        exchange ends, whatever ends it: the stream body's ``__aexit__``, the handler's
        ``finally``, and, as a net for cancellations that land between admission and the
        response, the ASGI connection's own ``finally``. All are synchronous and
        idempotent (quart-trio cancels the request scope on a client disconnect).
Rule 4: a stream's frames are written by its own response task: everything pending for it
        goes out in one write, so a slow reader only coarsens its own delivery. With many
        streams open, mid-stream writes are batched to leave CPU to the engine
        (``_Writers``); a stream's first token and its end are never held back.
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import os
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import attrs
import trio
from quart import Response, request
from quart.wrappers.response import ResponseBody
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from inference_lab.config import Deployment, Workload, load_model_config, load_workload
from inference_lab.engine import Finished
from inference_lab.errors import ConfigError
from inference_lab.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    ParsedRequest,
    StreamEncoder,
    completion_body,
    error_body,
    new_request_id,
    parse_capacity_request,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
)
from inference_lab.runtime import (
    EngineUnavailable,
    ModelRuntime,
    QueueFull,
    RequestHandle,
    RuntimeSnapshot,
)
from inference_lab.workload import make_rng

__all__ = ["ServeSettings", "ServeState", "create_app", "get_state", "load_settings"]

DEFAULT_CONFIG = "configs/"
DEFAULT_HARDWARE = "b200"
DEFAULT_MAX_TOKENS = 256
_CLEANUP_KEY = "inference_lab.cleanup"
#: The garbage collector's thresholds in a server process (``gc.set_threshold``). At 256
#: streams the defaults (700, 10, 10) ran ~1600 young, 150 middle and 13 full collections
#: in 9 s, 0.9 s of CPU; these run about one young collection a second (~8 ms each).
GC_THRESHOLDS = (10_000, 20, 20)
_JSON = "application/json"


# ---------------------------------------------------------------------------------------
# settings


@attrs.frozen(kw_only=True)
class ServeSettings:
    """Everything a serving app needs, loaded and validated (see :func:`load_settings`)."""

    deployments: tuple[Deployment, ...]
    workload: Workload | None = None
    seed: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS


def _default_config_path(config: str | os.PathLike[str]) -> Path:
    path = Path(config)
    if str(config) == DEFAULT_CONFIG and not path.exists():
        # Installed elsewhere than the repository root: use the shipped configs.
        shipped = Path(__file__).resolve().parent.parent / "configs"
        if shipped.is_dir():
            return shipped
    return path


def load_settings(
    *,
    config: str | os.PathLike[str] = DEFAULT_CONFIG,
    hardware: str = DEFAULT_HARDWARE,
    max_waiting: int | None = None,
    max_num_seqs: int | None = None,
    workload: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    on_skip: Callable[[str], None] | None = None,
) -> ServeSettings:
    """Load the models to serve (``serve-api.md``, Command line); raises ConfigError.

    ``config`` is one model config or a directory of them (``*.toml``, sorted, not
    recursive). In directory mode a file without a ``[hardware.<hardware>]`` entry is
    skipped and reported through ``on_skip``; an invalid file, two configs with the same
    model name, or no model left is an error. ``max_waiting`` / ``max_num_seqs``
    override every model's ``[scheduler]`` value.
    """
    if max_waiting is not None and max_waiting < 0:
        raise ConfigError(f"max_waiting: must be >= 0, got {max_waiting}")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    if default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens: must be >= 1, got {default_max_tokens}")
    path = _default_config_path(config)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.toml") if p.is_file())
        if not files:
            raise ConfigError(f"{path}: no model configs (*.toml) in this directory")
        directory = True
    elif path.is_file():
        files = [path]
        directory = False
    else:
        raise ConfigError(f"{path}: no such file or directory")
    deployments: list[Deployment] = []
    seen: dict[str, Path] = {}
    for file in files:
        model_config = load_model_config(file)
        if hardware not in model_config.deployments:
            available = ", ".join(model_config.deployments)
            if not directory:
                raise ConfigError(
                    f"{file}: hardware.{hardware}: no such entry (available: {available})"
                )
            if on_skip is not None:
                on_skip(f"skipping {file}: no [hardware.{hardware}] entry (has {available})")
            continue
        dep = model_config.deployments[hardware]
        name = dep.model.name
        if name in seen:
            raise ConfigError(
                f"{file}: model.name: '{name}' is already served by {seen[name]} "
                "(model names must be unique)"
            )
        seen[name] = file
        sched = dep.scheduler
        if max_waiting is not None:
            sched = attrs.evolve(sched, max_waiting=max_waiting)
        if max_num_seqs is not None:
            sched = attrs.evolve(sched, max_num_seqs=max_num_seqs)
        deployments.append(attrs.evolve(dep, scheduler=sched))
    if not deployments:
        raise ConfigError(f"{path}: no model config has a [hardware.{hardware}] entry")
    loaded = load_workload(workload) if workload is not None else None
    return ServeSettings(
        deployments=tuple(deployments),
        workload=loaded,
        seed=seed,
        default_max_tokens=default_max_tokens,
    )


def parse_int_setting(raw: str, lowest: int) -> int:
    """An integer setting given as text (a flag or an environment variable); ValueError
    with the tail of a one-line message when it is not an integer >= ``lowest``."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"must be an integer >= {lowest}, got {raw!r}") from None
    if value < lowest:
        raise ValueError(f"must be an integer >= {lowest}, got {value}")
    return value


def _env_int(environ: Mapping[str, str], name: str, lowest: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse_int_setting(raw, lowest)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


_TRUE = ("1", "true", "yes", "on")


def settings_from_env(environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings for a plain hypercorn launch, one variable per ``serve`` flag:
    ``INFERENCE_LAB_CONFIG``, ``_HARDWARE``, ``_MAX_WAITING``, ``_MAX_NUM_SEQS``,
    ``_WORKLOAD``, ``_SEED``, ``_DEFAULT_MAX_TOKENS``, ``_ENABLE_TEST_HARNESS``."""
    env = os.environ if environ is None else environ
    if env.get("INFERENCE_LAB_ENABLE_TEST_HARNESS", "").strip().lower() in _TRUE:
        raise ConfigError(
            "INFERENCE_LAB_ENABLE_TEST_HARNESS: the test-harness features (fault injection, "
            "scripted responses) are not built in this version"
        )
    default_max_tokens = _env_int(env, "INFERENCE_LAB_DEFAULT_MAX_TOKENS", 1)
    return load_settings(
        config=env.get("INFERENCE_LAB_CONFIG") or DEFAULT_CONFIG,
        hardware=env.get("INFERENCE_LAB_HARDWARE") or DEFAULT_HARDWARE,
        max_waiting=_env_int(env, "INFERENCE_LAB_MAX_WAITING", 0),
        max_num_seqs=_env_int(env, "INFERENCE_LAB_MAX_NUM_SEQS", 1),
        workload=env.get("INFERENCE_LAB_WORKLOAD") or None,
        seed=_env_int(env, "INFERENCE_LAB_SEED", 0),
        default_max_tokens=default_max_tokens or DEFAULT_MAX_TOKENS,
        on_skip=lambda line: print(f"inference-lab: {line}", file=sys.stderr),
    )


# ---------------------------------------------------------------------------------------
# serving state


@attrs.define(kw_only=True)
class ServeState:
    """The models one app serves, in load order, and when the app was created."""

    settings: ServeSettings
    runtimes: dict[str, ModelRuntime]
    created: int
    writers: _Writers = attrs.field(factory=lambda: _Writers())
    freeze_gc: bool = False

    @classmethod
    def build(cls, settings: ServeSettings, *, freeze_gc: bool = False) -> ServeState:
        runtimes: dict[str, ModelRuntime] = {}
        for dep in settings.deployments:
            workload = settings.workload
            runtimes[dep.model.name] = ModelRuntime(
                dep,
                output_lengths=workload.output_len_dist if workload is not None else None,
                rng=make_rng(workload, settings.seed) if workload is not None else None,
            )
        return cls(
            settings=settings, runtimes=runtimes, created=int(time.time()), freeze_gc=freeze_gc
        )

    async def start(self, nursery: trio.Nursery) -> None:
        if self.freeze_gc:
            # Everything loaded so far (modules, configs, engines) lives as long as the
            # process: freezing it keeps the rare full garbage collections short (they
            # otherwise stall the pacer for ~40 ms on this stack).
            gc.freeze()
            # Almost everything a request allocates dies by reference counting; with the
            # default threshold (700) the young-generation collections that keep finding
            # nothing cost ~10 % of the CPU at 256 streams (see GC_THRESHOLDS).
            gc.set_threshold(*GC_THRESHOLDS)
        await nursery.start(self.writers.run)
        for runtime in self.runtimes.values():
            await nursery.start(runtime.run)

    async def stop(self) -> None:
        self.writers.stop()
        for runtime in self.runtimes.values():
            runtime.stop()
        for runtime in self.runtimes.values():
            await runtime.wait_stopped()


def get_state(app: QuartTrio) -> ServeState:
    return cast(ServeState, app.extensions["inference_lab"])


# ---------------------------------------------------------------------------------------
# error mapping (the one place)


def _json_response(body: bytes, status: int, headers: dict[str, str] | None = None) -> Response:
    response = Response(body, status=status, content_type=_JSON)
    if headers:
        for name, value in headers.items():
            response.headers[name] = value
    return response


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _error_response(exc: BaseException) -> Response:
    """Every error the app answers, as (status, body, headers)."""
    if isinstance(exc, ApiError):
        return _json_response(exc.body(), exc.status)
    if isinstance(exc, QueueFull):
        body = _dumps(
            {"error": {"message": str(exc), "type": "overloaded_error", "code": "queue_saturated"}}
        )
        return _json_response(body, 529, {"x-should-retry": "false"})
    if isinstance(exc, EngineUnavailable):
        body = error_body(str(exc), "service_unavailable_error", "engine_unavailable", None)
        return _json_response(body, 503)
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        if code == 404:
            message = f"No route for {request.method} {request.path}"
            return _json_response(
                error_body(message, "invalid_request_error", "not_found", None), 404
            )
        if code == 405:
            message = f"Method {request.method} not allowed on {request.path}"
            response = _json_response(
                error_body(message, "invalid_request_error", "method_not_allowed", None), 405
            )
            if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
                response.headers["allow"] = ", ".join(sorted(exc.valid_methods))
            return response
        if code == 413:
            message = f"Request body exceeds {MAX_BODY_BYTES} bytes"
            return _json_response(
                error_body(message, "invalid_request_error", "request_too_large", None), 413
            )
        kind = "invalid_request_error" if code < 500 else "server_error"
        name = (exc.name or "error").lower().replace(" ", "_")
        return _json_response(error_body(exc.description or name, kind, name, None), code)
    message = f"Internal server error: {type(exc).__name__}"
    return _json_response(error_body(message, "server_error", "internal_error", None), 500)


# ---------------------------------------------------------------------------------------
# the ASGI connection: the two stack fixes


class _LabHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection with two fixes.

    * The final (``more_body: False``) send is shielded. quart-trio cancels the request
      scope when hypercorn reports the disconnect that its own end-of-response handling
      emits, and that cancellation landed inside the final send, after the body but
      before hypercorn closed a ``Connection: close`` connection or re-armed the idle
      keep-alive timer (hypercorn issue #330): such sockets were never closed.
    * Whatever ends the exchange, every request handle registered in the scope is closed
      (synchronously) when the connection task ends.
    """

    async def __call__(self, receive: Any, send: Any) -> None:
        try:
            await super().__call__(receive, send)
        finally:
            scope = cast(dict[str, Any], self.scope)
            for cleanup in scope.get(_CLEANUP_KEY, ()):
                cleanup()

    async def handle_request(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, send: Any
    ) -> None:
        async def send_shielding_final(message: Any) -> None:
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().handle_request(nursery, request, send_shielding_final)


class InferenceLabApp(QuartTrio):
    asgi_http_class = _LabHTTPConnection


# ---------------------------------------------------------------------------------------
# per-request sinks and the stream body


class _Writers:
    """How often mid-stream tokens are written when many streams are open.

    Every SSE write costs the HTTP stack ~50-100 us of CPU, and each stream's writer is a
    task that every other task's next scheduling turn waits behind. With many streams open,
    a writer that has just written waits ``interval()`` before writing the tokens that
    arrived meanwhile (all in one write). The first token and the end of a stream (finish,
    usage, [DONE], an error) are never held back, so TTFT and E2E are unaffected; only the
    granularity of mid-stream delivery coarsens, as it would under CPU load anyway.

    The hold-backs are timed by one **releaser** task (:meth:`run`, started with the
    runtimes) rather than a timeout per writer: a held writer parks, and the releaser
    wakes every writer whose hold-back has expired in one pass. A trio timeout is a
    cancellation (exception, abort, rescheduling); ~10k of them a second cost several per
    cent of the CPU at 256 streams. Without a running releaser (an app that never started
    serving) a writer times its own hold-back.
    """

    __slots__ = ("open", "running", "_held", "_seq", "_lot", "_sleeping_until", "_scope")

    #: Streams that may write every token with no hold-back.
    FREE_STREAMS = 8
    #: Seconds of hold-back per open stream above FREE_STREAMS.
    PER_STREAM = 0.0001

    def __init__(self) -> None:
        self.open = 0
        self.running = False
        self._held: list[tuple[float, int, _StreamSink]] = []  # heap of (until, seq, sink)
        self._seq = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._sleeping_until = math.inf
        self._scope: trio.CancelScope | None = None

    def interval(self) -> float:
        return max(0, self.open - self.FREE_STREAMS) * self.PER_STREAM

    def hold(self, sink: _StreamSink, until: float) -> None:
        """Have the releaser wake ``sink``'s writer at ``until`` (unless it has stopped
        holding by then: ``sink.hold_until`` names the hold-back an entry belongs to)."""
        sink.hold_until = until
        self._seq += 1
        heapq.heappush(self._held, (until, self._seq, sink))
        if until < self._sleeping_until:
            self._lot.unpark_all()  # the releaser sleeps too long (or idles): re-arm it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The releaser: wake held writers when their hold-back ends (runs until cancelled)."""
        held = self._held
        lot = self._lot
        self.running = True
        self._scope = trio.CancelScope()
        task_status.started()
        try:
            with self._scope:
                await self._release(held, lot)
        finally:
            self.running = False
            self._sleeping_until = math.inf
            for _, _, sink in held:
                sink.lot.unpark_all()
            held.clear()

    def stop(self) -> None:
        """End the releaser (the serving teardown calls it: hypercorn would otherwise wait
        for it). Held writers are woken and time their own hold-backs from then on."""
        if self._scope is not None:
            self._scope.cancel()

    async def _release(
        self, held: list[tuple[float, int, _StreamSink]], lot: trio.lowlevel.ParkingLot
    ) -> None:
        """Wake held writers whose hold-back has ended; sleep until the next one."""
        while True:
            now = trio.current_time()
            while held and held[0][0] <= now:
                until, _, sink = heapq.heappop(held)
                if sink.hold and sink.hold_until == until:
                    sink.lot.unpark_all()
            if held:
                self._sleeping_until = held[0][0]
                with trio.move_on_at(self._sleeping_until):
                    await lot.park()
            else:
                self._sleeping_until = math.inf
                await lot.park()


class _StreamSink:
    """A streaming request's pending output: the opening frame, a count of token frames
    not yet written (``written .. emitted``, encoded only when written) and the end
    frames. The engine task's per-token work is a counter update.

    ``waiting`` is set while the writer is parked for frames: new tokens wake it. ``hold``
    is set while the writer deliberately waits (see :class:`_Writers`): new tokens then do
    not wake it, the end of the stream does."""

    __slots__ = (
        "encoder",
        "opening",
        "written",
        "emitted",
        "closing",
        "done",
        "lot",
        "hold",
        "hold_until",
        "waiting",
    )

    def __init__(self, encoder: StreamEncoder) -> None:
        self.encoder = encoder
        self.opening = encoder.opening()
        self.written = 0
        self.emitted = 0
        self.closing = b""
        self.done = False
        self.hold = False
        self.hold_until = 0.0
        self.waiting = False
        self.lot = trio.lowlevel.ParkingLot()

    def pending(self) -> bool:
        return bool(self.opening or self.emitted > self.written or self.closing)

    def take(self) -> bytes:
        """Everything pending, in order (opening, tokens, end), marked written."""
        data = self.opening
        self.opening = b""
        if self.emitted > self.written:
            data += self.encoder.tokens(self.written, self.emitted)
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
            self.waiting = False
            self.lot.unpark_all()

    def on_finished(self, finished: Finished) -> None:
        self.closing = self.encoder.closing(finished.finish_reason, finished.output_tokens)
        self._end()

    def on_failed(self, message: str) -> None:
        self.closing = StreamEncoder.failure(message)
        self._end()

    def _end(self) -> None:
        self.done = True
        if self.waiting or self.hold:
            self.waiting = False
            self.lot.unpark_all()


class _CollectSink:
    """A non-streaming request: wakes its handler when the request ends."""

    __slots__ = ("event", "finished", "failure")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.finished: Finished | None = None
        self.failure: str | None = None

    def on_tokens(self, count: int) -> None:
        pass

    def on_finished(self, finished: Finished) -> None:
        self.finished = finished
        self.event.set()

    def on_failed(self, message: str) -> None:
        self.failure = message
        self.event.set()


class _StreamBody(ResponseBody):
    """The SSE body: each iteration writes every frame pending for the stream at once."""

    def __init__(self, sink: _StreamSink, handle: RequestHandle, writers: _Writers) -> None:
        self._sink = sink
        self._handle = handle
        self._writers = writers
        self._counted = False
        self._iterator: AsyncGenerator[bytes, None] | None = None

    async def __aenter__(self) -> AsyncIterator[bytes]:
        self._writers.open += 1
        self._counted = True
        self._iterator = self._frames()
        return self._iterator

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()
        # Finalise the generator now rather than at garbage collection (its cleanup is
        # synchronous, so this completes even in a cancelled scope).
        if self._iterator is not None:
            await self._iterator.aclose()

    def _close(self) -> None:
        if self._counted:
            self._counted = False
            self._writers.open -= 1
        self._handle.close()

    async def _frames(self) -> AsyncGenerator[bytes, None]:
        sink = self._sink
        lot = sink.lot
        writers = self._writers
        try:
            while True:
                while not sink.pending():
                    if sink.done:
                        return
                    sink.waiting = True
                    try:
                        await lot.park()
                    finally:
                        sink.waiting = False
                yield sink.take()
                interval = writers.interval()
                if interval > 0 and sink.emitted and not sink.done:
                    sink.hold = True
                    try:
                        if writers.running:
                            writers.hold(sink, trio.current_time() + interval)
                            await lot.park()  # woken by the releaser or the end of the stream
                        else:
                            with trio.move_on_after(interval):
                                await lot.park()  # woken early only by the end of the stream
                    finally:
                        sink.hold = False
        finally:
            self._close()


# ---------------------------------------------------------------------------------------
# the app


def _capacity_entry(snap: RuntimeSnapshot) -> dict[str, Any]:
    return {
        "model": snap.model,
        "max_waiting": snap.max_waiting,
        "max_num_seqs": snap.max_num_seqs,
        "waiting": snap.depth,
        "running": snap.running,
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def create_app(
    settings: ServeSettings | None = None, *, freeze_gc: bool | None = None
) -> InferenceLabApp:
    """The serve app. With ``settings`` None it is configured from the environment
    (:func:`settings_from_env`), for ``hypercorn 'inference_lab.serve:create_app()'``.

    The per-model runtimes start in the app's serving lifespan and stop in its teardown.
    One app object serves once: create a fresh one per server (tests included).
    ``freeze_gc`` (default: only for an environment-configured app, i.e. a whole server
    process) calls ``gc.freeze()`` when serving starts.
    """
    if freeze_gc is None:
        freeze_gc = settings is None
    if settings is None:
        settings = settings_from_env()
    app = InferenceLabApp(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    state = ServeState.build(settings, freeze_gc=freeze_gc)
    app.extensions["inference_lab"] = state
    default_max_tokens = settings.default_max_tokens

    @app.before_serving
    async def _start_runtimes() -> None:
        await state.start(app.nursery)

    @app.after_serving
    async def _stop_runtimes() -> None:
        # hypercorn cancels the app's background nursery right after this returns:
        # stop the runtimes here and wait for them, so nothing is cut mid-step.
        await state.stop()

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        return _error_response(exc)

    @app.errorhandler(Exception)
    async def _internal_error(exc: Exception) -> Response:
        app.logger.exception("unhandled error", exc_info=exc)
        return _error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        stopped = {name: rt.snapshot().alive for name, rt in state.runtimes.items()}
        if all(stopped.values()):
            return _json_response(b'{"status":"ok"}', 200)
        models = {name: ("running" if alive else "stopped") for name, alive in stopped.items()}
        return _json_response(_dumps({"status": "unavailable", "models": models}), 503)

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "inference-lab"}
            for name in state.runtimes
        ]
        return _json_response(_dumps({"object": "list", "data": data}), 200)

    @app.get("/control/capacity")
    async def get_capacity() -> Response:
        body = [_capacity_entry(rt.snapshot()) for rt in state.runtimes.values()]
        return _json_response(_dumps(body), 200)

    @app.post("/control/capacity")
    async def post_capacity() -> Response:
        try:
            raw = parse_json_object(await _read_body())
            change = parse_capacity_request(raw)
            if change.model is None:
                targets = list(state.runtimes.values())
            elif change.model in state.runtimes:
                targets = [state.runtimes[change.model]]
            else:
                raise _model_not_found(change.model, state)
        except (ApiError, HTTPException) as exc:
            return _error_response(exc)
        for runtime in targets:
            runtime.set_capacity(max_num_seqs=change.max_num_seqs, max_waiting=change.max_waiting)
        return _json_response(_dumps([_capacity_entry(rt.snapshot()) for rt in targets]), 200)

    @app.get("/control/stats")
    async def stats() -> Response:
        """Runtime statistics (not in the OpenAI API): engine counters and pacing lag.
        ``?last=N`` computes the lag percentiles over the last N engine events,
        ``?finished=M`` the median simulated E2E over the last M completions."""
        last_arg = request.args.get("last", "")
        last = int(last_arg) if last_arg.isdigit() else None
        finished_arg = request.args.get("finished", "")
        finished = int(finished_arg) if finished_arg.isdigit() else None
        out = []
        for rt in state.runtimes.values():
            st = rt.statistics(last, finished)
            snap, eng = st.snapshot, st.engine
            out.append(
                {
                    "model": snap.model,
                    "alive": snap.alive,
                    "waiting": snap.depth,
                    "running": snap.running,
                    "max_num_seqs": snap.max_num_seqs,
                    "max_waiting": snap.max_waiting,
                    "admitted": snap.admitted,
                    "refused": snap.refused,
                    "sim_time": st.sim_time,
                    "wall_time": st.wall_time,
                    "steps": eng.steps,
                    "finished": eng.finished,
                    "aborted": eng.aborted,
                    "preemptions": eng.preemptions,
                    "kv_usage": eng.kv_usage,
                    "sim_e2e_ms": {"count": st.e2e_count, "p50": _ms(st.e2e_p50)},
                    "pacing_lag_ms": {
                        "events": snap.events,
                        "total": _ms(st.lag_total),
                        "mean": _ms(snap.lag_mean),
                        "max": _ms(snap.lag_max),
                        "window_p50": _ms(st.lag_p50),
                        "window_p99": _ms(st.lag_p99),
                        "window_max": _ms(st.lag_max_recent),
                    },
                }
            )
        return _json_response(_dumps(out), 200)

    async def generate(kind: str) -> Response:
        handle: RequestHandle | None = None
        try:
            raw = parse_json_object(await _read_body())
            if kind == "chat":
                parsed = parse_chat_request(raw, default_max_tokens)
            else:
                parsed = parse_completion_request(raw, default_max_tokens)
            runtime = state.runtimes.get(parsed.model)
            if runtime is None:
                raise _model_not_found(parsed.model, state)
            engine_prompt = max(1, parsed.prompt_tokens)
            refused = runtime.check_fits(engine_prompt, parsed.max_tokens)
            if refused is not None:
                raise ApiError(400, "context_length_exceeded", refused.reason, "max_tokens")
            request_id = new_request_id(parsed.kind)
            created = int(time.time())
            if parsed.stream:
                sink: _StreamSink | _CollectSink = _StreamSink(
                    StreamEncoder(parsed, request_id=request_id, created=created)
                )
            else:
                sink = _CollectSink()
            handle = runtime.admit_nowait(
                prompt_tokens=engine_prompt,
                max_tokens=parsed.max_tokens,
                priority=parsed.priority,
                sink=sink,
            )
        except (ApiError, QueueFull, EngineUnavailable, HTTPException) as exc:
            return _error_response(exc)
        scope = cast(dict[str, Any], request.scope)
        scope.setdefault(_CLEANUP_KEY, []).append(handle.close)
        if isinstance(sink, _StreamSink):
            response = Response(
                _StreamBody(sink, handle, state.writers),
                status=200,
                content_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
            response.timeout = None
            return response
        try:
            await sink.event.wait()
        finally:
            handle.close()
        return _complete(parsed, sink, request_id, created)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completions")

    return app


async def _read_body() -> bytes:
    return cast(bytes, await request.get_data(cache=False, as_text=False))


def _model_not_found(model: str, state: ServeState) -> ApiError:
    available = ", ".join(state.runtimes)
    return ApiError(
        404,
        "model_not_found",
        f"Model '{model}' not found. Available models: {available}",
        "model",
    )


def _complete(parsed: ParsedRequest, sink: _CollectSink, request_id: str, created: int) -> Response:
    if sink.finished is None:
        message = sink.failure or "The engine failed."
        return _json_response(error_body(message, "server_error", "engine_failed", None), 500)
    body = completion_body(
        parsed,
        request_id=request_id,
        created=created,
        completion_tokens=sink.finished.output_tokens,
        finish_reason=sink.finished.finish_reason,
    )
    return _json_response(body, 200)
