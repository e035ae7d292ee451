"""The proxy's ASGI app (served by hypercorn's trio worker: ``proxy/cli.py``).

- ``POST /v1/chat/completions``, ``POST /v1/completions``: the two-step hand-off
  (``proxy/handoff.py``);
- ``GET /v1/models``: passed to the decode pool (the first backend that answers), so a
  client that checks the model list (``inference-lab load``) works through the proxy;
- ``GET /health``: the proxy's own liveness; ``GET /stats``: what it did (JSON);
- anything else: 404 (405 for another method on a route) in the OpenAI envelope.

Rule 1: a request body is read whole before any backend is called, at most
        :data:`MAX_BODY_BYTES` bytes, and must be one JSON object (400 ``invalid_json``
        otherwise); nothing else in it is checked here: the backends answer for it.
Rule 2: a client that leaves ends its request: the backend calls in flight are cancelled
        (their connections closed, so the backends see their client gone) and held KV is
        released (``handoff.py`` Rule 2).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio

from inference_lab.client.http import Connect, Origin, connect_tcp_unstamped
from inference_lab.errors import error_body
from inference_lab.jsonbytes import dumps
from inference_lab.proxy.backends import BackendFailed, Exchange, Policy, Pool
from inference_lab.proxy.handoff import (
    HandoffStats,
    ProxyReply,
    Receive,
    Send,
    request_headers,
    serve_completion,
    unavailable,
)

__all__ = ["MAX_BODY_BYTES", "ProxyApp", "ProxyConfig"]

#: The largest request body the proxy reads (a little over a server's own 2 MiB).
MAX_BODY_BYTES = 4 << 20
#: The completion routes.
COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_JSON = ((b"content-type", b"application/json"),)


@attrs.frozen(kw_only=True)
class ProxyConfig:
    """What a proxy fronts and how."""

    prefill: tuple[Origin, ...]
    decode: tuple[Origin, ...]
    policy: Policy = "round_robin"
    #: Ask a decode backend before the prefill (``handoff.py``, step 1).
    probe: bool = True
    #: Seconds any one wait on a backend may last (``backends.py`` Rule 3).
    backend_timeout: float = 600.0


def _error(
    status: int, message: str, code: str, type_: str = "invalid_request_error"
) -> ProxyReply:
    return ProxyReply(status, error_body(message, type_, code, None), _JSON)


async def _reply(send: Send, reply: ProxyReply) -> None:
    headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        data = message.get("body", b"")
        size += len(data)
        if size > MAX_BODY_BYTES:
            raise _TooLarge
        parts.append(data)
        if not message.get("more_body", False):
            return b"".join(parts)


class ProxyApp:
    """The proxy (module rules); ``connect`` opens its backend connections (tests pass
    their own)."""

    def __init__(self, config: ProxyConfig, *, connect: Connect = connect_tcp_unstamped) -> None:
        self.config = config
        self.prefill = Pool("prefill", config.prefill, config.policy, connect=connect)
        self.decode = Pool("decode", config.decode, config.policy, connect=connect)
        self.stats = HandoffStats()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.prefill.close()
                self.decode.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path in COMPLETION_PATHS:
            if method != "POST":
                await _reply(
                    send, _error(405, f"{method} {path} is not allowed", "method_not_allowed")
                )
                return
            await self._completion(scope, receive, send)
        elif path == "/v1/models" and method == "GET":
            await self._models(scope, send)
        elif path == "/health" and method == "GET":
            await _reply(send, ProxyReply(200, b'{"status":"ok"}', _JSON))
        elif path == "/stats" and method == "GET":
            await _reply(send, ProxyReply(200, dumps(self.statistics()), _JSON))
        else:
            await _reply(send, _error(404, f"no route {method} {path}", "route_not_found"))

    async def _completion(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(receive)
        except _TooLarge:
            await _reply(
                send, _error(413, f"the body passes {MAX_BODY_BYTES} bytes", "body_too_large")
            )
            return
        except _Gone:
            return
        read_at = trio.current_time()
        try:
            raw = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raw = None
        if type(raw) is not dict:
            await _reply(send, _error(400, "Request body must be a JSON object", "invalid_json"))
            return
        config = self.config
        async with trio.open_nursery() as nursery:

            async def watch() -> None:  # Rule 2
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await serve_completion(
                scope["path"],
                raw,
                request_headers(scope),
                send,
                prefill=self.prefill,
                decode=self.decode,
                probe=config.probe,
                backend_timeout=config.backend_timeout,
                stats=self.stats,
                read_at=read_at,
            )
            nursery.cancel_scope.cancel()

    async def _models(self, scope: dict[str, Any], send: Send) -> None:
        headers = request_headers(scope)
        down: list[str] = []
        for backend in self.decode.order():
            try:
                async with Exchange(
                    backend, self.config.backend_timeout, "GET", "/v1/models", headers
                ) as answer:
                    data = await answer.body(MAX_BODY_BYTES)
            except BackendFailed as exc:
                down.append(str(exc))
                continue
            await _reply(send, ProxyReply(answer.status, data, tuple(answer.headers)))
            return
        await _reply(send, unavailable("no decode backend could be reached: " + "; ".join(down)))

    def statistics(self) -> dict[str, Any]:
        """``GET /stats``: requests by outcome, each stage's count, total and mean (ms:
        ``handoff.py``'s :class:`HandoffStats`) and the backends."""
        s = self.stats
        return {
            "requests": s.requests,
            "completed": s.completed,
            "passed_refusals": s.passed_refusals,
            "probe_refusals": s.probe_refusals,
            "unavailable": s.unavailable,
            "released": s.released,
            "stages": s.summary(),
            "prefill": [b.statistics() for b in self.prefill.backends],
            "decode": [b.statistics() for b in self.decode.backends],
        }
