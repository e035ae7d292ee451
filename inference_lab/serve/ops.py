"""vLLM's operational routes: ``/ping`` and ``/invocations`` (SageMaker), ``/load``,
``/reset_prefix_cache`` and sleep mode (``/sleep``, ``/wake_up``, ``/is_sleeping``).

Rule 1: ``/ping`` answers as ``/health`` does and ``/load`` counts the requests in flight
        (vLLM's ``server_load``); both are open, as probes are. ``/invocations`` answers a
        body as the route its shape names (``messages``: chat completions; ``prompt``:
        completions; ``input``: embeddings), as vLLM's SageMaker entry does, behind the
        API key.
Rule 2: the development routes vLLM serves only with ``VLLM_SERVER_DEV_MODE=1``
        (``/reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``/is_sleeping``) are behind
        the control plane's rules (``gate.DEV_PATHS``: loopback only, or the control
        token). Each
        takes ``?model=`` to address one model; without it, every model.
Rule 3: ``/sleep`` refuses new requests at once (503 ``engine_sleeping``); in its
        ``abort`` mode (vLLM's default) it ends the live ones with an error naming the
        sleep, in ``wait`` mode it waits for them; then the prefix cache is dropped, and
        the answer comes when the priced sleep is over
        (:mod:`inference_lab.serve.sleep_mode`). ``/wake_up`` answers when the priced
        wake-up is over, and the model admits requests again once its weights and KV
        cache are both back. Sleeps and wake-ups of one model run one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio

from inference_lab.api.schema import parse_json_object
from inference_lab.errors import ApiError
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.agent_routes import AGENT_ROUTES, request_body
from inference_lab.serve.completions import complete
from inference_lab.serve.error_replies import error_reply, json_reply, send_reply
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.health import health_reply
from inference_lab.serve.routes import to_response
from inference_lab.serve.sleep_mode import TAGS, sleep_seconds, wake_seconds
from inference_lab.serve.state import ServeState

__all__ = ["INVOCATIONS", "invocations", "register_ops_routes"]

#: SageMaker's inference path.
INVOCATIONS = "/invocations"
#: The priced seconds an answer reports are rounded to the microsecond.
_ROUND = 6


@attrs.define
class _Sleep:
    """One model's sleep: its level (0 awake) and what a wake-up has restored so far."""

    level: int = 0
    restored: set[str] = attrs.field(factory=set)
    lock: trio.Lock = attrs.field(factory=trio.Lock)


def _query_models(state: ServeState) -> list[ModelRuntime]:
    name = request.args.get("model")
    if name is None:
        return list(state.runtimes.values())
    runtime = state.runtimes.get(name)
    if runtime is None:
        raise state.model_not_found(name)
    return [runtime]


def _choice(name: str, allowed: Iterable[str], default: str) -> str:
    value = request.args.get(name, default)
    options = tuple(allowed)
    if value not in options:
        raise ApiError(
            400, "invalid_value", f"{name} must be one of {', '.join(options)}, got {value!r}", name
        )
    return value


def _refusal(exc: ApiError) -> Response:
    return to_response(error_reply(exc, method=request.method, path=request.path))


def register_ops_routes(app: QuartTrio, state: ServeState) -> None:
    """Add the operational routes (module rules) to ``app``."""
    _register_probe_routes(app, state)
    _register_sleep_routes(app, state)


def _register_probe_routes(app: QuartTrio, state: ServeState) -> None:
    """``/ping``, ``/load`` and ``POST /reset_prefix_cache``."""

    @app.route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return to_response(health_reply(state))

    @app.get("/load")
    async def load() -> Response:
        live = sum(rt.live for rt in state.runtimes.values())
        return to_response(json_reply({"server_load": live}))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            targets = _query_models(state)
            for flag in ("reset_running_requests", "reset_external"):
                if request.args.get(flag, "false").lower() not in ("false", "0"):
                    raise ApiError(
                        400, "unsupported_value", f"{flag} is not supported (false only)", flag
                    )
        except ApiError as exc:
            return _refusal(exc)
        done = {rt.name: rt.reset_prefix_cache() for rt in targets}
        return to_response(json_reply({"reset": done}))


def _register_sleep_routes(app: QuartTrio, state: ServeState) -> None:
    """vLLM's sleep mode: ``GET /is_sleeping``, ``POST /sleep`` and ``POST /wake_up``."""
    sleeps: dict[str, _Sleep] = {}

    def sleep_of(runtime: ModelRuntime) -> _Sleep:
        record = sleeps.setdefault(runtime.name, _Sleep())
        if runtime.sleep_level == 0 and record.level:  # a fresh runtime (harness restart)
            record.level, record.restored = 0, set()
        return record

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        try:
            targets = _query_models(state)
        except ApiError as exc:
            return _refusal(exc)
        levels = {rt.name: rt.sleep_level for rt in targets}
        return to_response(json_reply({"is_sleeping": all(levels.values()), "levels": levels}))

    @app.post("/sleep")
    async def sleep() -> Response:
        try:
            targets = _query_models(state)
            level = int(_choice("level", ("1", "2"), "1"))
            mode = _choice("mode", ("abort", "wait"), "abort")
        except ApiError as exc:
            return _refusal(exc)
        seconds = {}
        async with trio.open_nursery() as nursery:
            for runtime in targets:
                seconds[runtime.name] = sleep_seconds(runtime.deployment, level)
                nursery.start_soon(_sleep_one, runtime, sleep_of(runtime), level, mode)
        return to_response(json_reply({"level": level, "seconds": _rounded(seconds)}))

    @app.post("/wake_up")
    async def wake_up() -> Response:
        try:
            targets = _query_models(state)
            tags = _wake_tags()
        except ApiError as exc:
            return _refusal(exc)
        seconds: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            for runtime in targets:
                record = sleep_of(runtime)
                seconds[runtime.name] = wake_seconds(runtime.deployment, record.level, tags)
                nursery.start_soon(_wake_one, runtime, record, set(tags))
        return to_response(json_reply({"seconds": _rounded(seconds)}))


def _wake_tags() -> list[str]:
    """``?tags=``: what ``POST /wake_up`` restores (default: everything); a 400 naming
    ``tags`` for one that is not among :data:`TAGS`."""
    tags = request.args.getlist("tags") or list(TAGS)
    for tag in tags:
        if tag not in TAGS:
            raise ApiError(
                400,
                "invalid_value",
                f"tags must be among {', '.join(TAGS)}, got {tag!r}",
                "tags",
            )
    return tags


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {name: round(value, _ROUND) for name, value in seconds.items()}


async def _sleep_one(runtime: ModelRuntime, record: _Sleep, level: int, mode: str) -> None:
    """Rule 3's sleep of one model."""
    async with record.lock:
        runtime.sleep_level = level  # new requests: 503 engine_sleeping
        record.level, record.restored = level, set()
        if mode == "abort":
            runtime.abort_live(
                f"The engine for model '{runtime.name}' was put to sleep (POST /sleep): "
                "this request was ended before it finished."
            )
        else:
            # The runtime publishes no idle event (as the shutdown's drain): poll it.
            while runtime.live:  # noqa: ASYNC110
                await trio.sleep(0.02)
        runtime.reset_prefix_cache()  # the KV cache and what it held are gone
        await trio.sleep(sleep_seconds(runtime.deployment, level))


async def _wake_one(runtime: ModelRuntime, record: _Sleep, tags: set[str]) -> None:
    """Rule 3's wake-up of one model."""
    async with record.lock:
        if not runtime.sleep_level:
            return
        await trio.sleep(wake_seconds(runtime.deployment, record.level, tags - record.restored))
        record.restored |= tags
        if record.restored >= set(TAGS):
            runtime.sleep_level = 0
            record.level, record.restored = 0, set()


# ---------------------------------------------------------------------------------------
# POST /invocations


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the route the body already read, then the connection's."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def invocations(state: ServeState, exchange: Exchange, receive: Receive, send: Send) -> None:
    """``POST /invocations`` (Rule 1): the route the body's shape names answers it."""
    body = await request_body(state, exchange, receive, send)
    if body is None:
        return
    try:
        raw = parse_json_object(body)
    except ApiError as exc:
        await send_reply(send, error_reply(exc), exchange.headers)
        return
    replay = _replay(body, receive)
    exchange.request_id = ""  # the route's own id (chatcmpl-..., cmpl-...)
    if "messages" in raw:
        await complete(state, "chat", exchange, replay, send)
    elif "prompt" in raw:
        await complete(state, "completions", exchange, replay, send)
    elif "input" in raw:
        await AGENT_ROUTES["/v1/embeddings"](state, exchange, replay, send)
    else:
        reply = error_reply(
            ApiError(
                400,
                "invalid_value",
                "/invocations takes a chat completions body (messages), a completions body "
                "(prompt) or an embeddings body (input)",
                None,
            )
        )
        await send_reply(send, reply, exchange.headers)
