"""Warm every code path of the completion routes before the first request.

The first request into a fresh process used to run 5-13 ms slow: cattrs generates its
structuring code on first use, numpy and the roofline build their caches on their first
step, and the request, sink, stream and error code paths run for the first time. A real
engine's first request is no slower than its second, so neither should this one be.

Rule 1: the warm-up runs on a throwaway :class:`ServeState` built from the same settings:
        the served runtimes never see it (their counters, clocks and statistics start
        untouched), and it is stopped before serving starts.
Rule 2: it drives :func:`inference_lab.serve.completions.complete` exactly as the app's
        ASGI connection does, with in-memory ``receive``/``send`` callables.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from inference_lab.serve.completions import Kind, complete
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.state import ServeState

__all__ = ["warm_up"]

#: Seconds the whole warm-up may take before it is abandoned (it takes ~10-50 ms).
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


async def warm_up(settings: ServeSettings) -> None:
    """Serve a handful of requests per model on a throwaway state (see the module rules).
    Called by :meth:`ServeState.start` in a server process, before the real runtimes
    start."""
    state = ServeState.build(settings)
    with trio.move_on_after(WARM_UP_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await state.start(nursery)
            try:
                for model in state.runtimes:
                    for kind, body in _requests(model):
                        await _exchange(state, kind, body)
            finally:
                await state.stop()
