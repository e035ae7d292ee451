"""Warm every code path of the completion routes before the first request.

A fresh process's first request would otherwise pay for first use: cattrs generates its
structuring code, numpy and the roofline build their caches on their first step, and the
request, sink, stream and error code paths run for the first time. A real engine's first
request is no slower than its second, so neither should this one be.

Rule 1: the warm-up runs on a throwaway :class:`ServeState` built from the same settings:
        the served runtimes never see it (their counters, clocks and statistics start
        untouched), and it is stopped before serving starts.
Rule 2: it drives :func:`inference_lab.serve.completions.complete` exactly as the app's
        ASGI connection does, first with in-memory ``receive``/``send`` callables, then
        through the transport's hooked HTTP/1.1 connection server over a local socket
        pair (:func:`inference_lab.serve.transport.local_connection`), so that the HTTP
        stack's request path, the arrival stamp and the single writes do not run cold
        either. Nothing listens and nothing leaves the process.
Rule 3: what the warm-up's runtimes learned of this machine's timer lateness (their
        pacers' early wake, runtime Rule 2) is handed to the served runtimes, so that the
        first request's tokens are released on time too, not late while a fresh runtime
        learns it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import trio

from inference_lab.runtime.calibration import PacingCalibration
from inference_lab.serve.completions import COMPLETION_ROUTES, Kind, complete
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import local_connection, received_at

__all__ = ["warm_up"]

logger = logging.getLogger(__name__)

#: Seconds the whole warm-up may take before it is abandoned (a bound far above its cost).
WARM_UP_TIMEOUT = 10.0


def _requests(model: str) -> list[tuple[Kind, dict[str, Any]]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "warm up"}]}
    return [
        ("chat", {**chat, "max_tokens": 2, "stream": True}),
        (
            "chat",
            {**chat, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        ),
        ("chat", {**chat, "max_tokens": 1}),
        ("completions", {"model": model, "prompt": "warm up", "max_tokens": 2, "stream": True}),
        ("completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "echo": True}),
        ("chat", {**chat, "max_tokens": 0}),  # a 400
        ("chat", {**chat, "model": "\u0000no such model"}),  # a 404
    ]


async def _exchange(state: ServeState, kind: Kind, body: dict[str, Any]) -> list[dict[str, Any]]:
    data = json.dumps(body).encode()
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions" if kind == "chat" else "/v1/completions",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
    }
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await complete(state, kind, Exchange(scope, trio.current_time()), receive, send)
    return sent


async def _through_hypercorn(state: ServeState, kind: Kind, body: dict[str, Any]) -> bytes:
    """One request through hypercorn's HTTP/1.1 connection server over a socket pair (the
    connection closes after it); the raw answer."""
    data = json.dumps(body).encode()
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    request = (
        f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            route = COMPLETION_ROUTES[scope["path"]]
            await complete(state, route, Exchange(scope, received_at(send)), receive, send)

    server, client = local_connection(app)
    answer = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await client.send_all(request)
        while chunk := await client.receive_some(65536):
            answer += chunk
        await client.aclose()
    return bytes(answer)


async def warm_up(settings: ServeSettings) -> dict[str, PacingCalibration]:
    """Serve a handful of requests per model on a throwaway state (see the module rules).
    Called by the app's start-up (``create_app``) in a server process, before the real runtimes
    start. Returns each model's pacing calibration, where its pacer learned one."""
    state = ServeState.build(settings)
    with trio.move_on_after(WARM_UP_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await state.start(nursery)
            try:
                for model in state.runtimes:
                    for kind, body in _requests(model):
                        await _exchange(state, kind, body)
                try:
                    for model in state.runtimes:
                        for kind, body in _requests(model):
                            await _through_hypercorn(state, kind, body)
                except Exception as exc:  # noqa: BLE001 - only a warm-up: serve regardless
                    logger.warning(
                        "warm-up through hypercorn skipped: %s: %s", type(exc).__name__, exc
                    )
            finally:
                await state.stop()
    learned = {name: runtime.calibration() for name, runtime in state.runtimes.items()}
    return {name: calibration for name, calibration in learned.items() if calibration.samples}
