"""The app's ASGI connection: where every HTTP request enters, and two stack fixes.

Rule 1: a request's arrival is the moment the server received it
        (:func:`inference_lab.serve.transport.received_at`).
Rule 2: every request passes :mod:`inference_lab.serve.gate` first (once a shutdown has
        begun, every request is refused there with a 503); then ``POST`` on a
        completion path goes straight to :func:`inference_lab.serve.completions.complete`,
        any other method on those paths is a 405; so do ``POST /v1/responses`` and
        ``POST /v1/embeddings`` to :mod:`inference_lab.serve.agent_routes` and the
        Messages API's two routes to :mod:`inference_lab.serve.messages_route` (whose
        refusals, the gate's included, are in Anthropic's envelope), and the pooling
        routes to :mod:`inference_lab.serve.pooling_routes`; every other
        request is handed to Quart (with the exchange's headers added to its response).
Rule 3: the final ``http.response.body`` of a Quart route is shielded from cancellation
        (hypercorn issue #330: quart-trio cancels the request scope when hypercorn reports
        the disconnect that its own end-of-response handling emits; a cancellation landing
        inside that send left ``Connection: close`` sockets open and keep-alive timers
        unarmed). The completion routes shield their own final sends.
Rule 4: a request Werkzeug refuses before Quart's error handlers exist (a ``Host`` it
        cannot bind) is answered with its error envelope too, never a bare 500.
Rule 6: ``GET /health`` and each served model's admission probe
        (``serve/kv_routes.py``) are answered by the connection's own task where they are
        read (``transport.quick``), before the queue of work; their routes answer them
        where that path does not apply.
Rule 7: while some model's waiting places are all taken, a completion request read whole
        in one read that its route would refuse with that model's 529 is refused by the
        connection's own task where it is read (``serve/quick_refusal.py``); every other
        outcome is the route's.
Rule 8: a prefill server's side-channel calls (``POST /kv_transfer/claim`` and
        ``/kv_transfer/release``) read whole in one read are answered by the connection's
        own task where they are read, with their raw route's very reply
        (``serve/kv_routes.py`` Rule 4): a decode request waits for its claim.
Rule 5: the app has no WebSocket endpoint: a WebSocket upgrade on any path is refused
        with a 404 in the OpenAI error envelope (the ASGI ``websocket.http.response``
        extension, which hypercorn offers), or closed where the server cannot answer
        HTTP to it. Nothing is logged.
"""

from __future__ import annotations

from typing import Any, cast

import trio
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from inference_lab.serve import gate
from inference_lab.serve.agent_routes import AGENT_ROUTES
from inference_lab.serve.completions import COMPLETION_ROUTES, complete
from inference_lab.serve.error_replies import (
    error_reply,
    method_not_allowed_reply,
    send_reply,
    websocket_refused_reply,
)
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.health import HEALTH_PATH
from inference_lab.serve.health import quick_answer as health_quick_answer
from inference_lab.serve.kv_routes import KV_QUICK_POSTS, KV_ROUTES, quick_admission, quick_kv
from inference_lab.serve.messages_route import MESSAGES_ROUTES, anthropic_reply, is_messages_path
from inference_lab.serve.ops import INVOCATIONS, invocations
from inference_lab.serve.pooling_routes import POOLING_ROUTES
from inference_lab.serve.quick_refusal import QUICK_POSTS, quick_refusal, refusing
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import QuickReply, received_at

__all__ = ["InferenceLabApp", "LabHTTPConnection", "RAW_ROUTES", "STATE_KEY", "get_state"]

#: Path -> the raw ASGI route serving ``POST`` on it, besides the completion routes.
RAW_ROUTES = {
    **AGENT_ROUTES,
    **MESSAGES_ROUTES,
    **POOLING_ROUTES,
    **KV_ROUTES,
    INVOCATIONS: invocations,
}

#: Where an app keeps its :class:`ServeState` (``app.extensions[STATE_KEY]``).
STATE_KEY = "inference_lab"


def get_state(app: Any) -> ServeState:
    """The :class:`ServeState` of an app made by ``create_app``."""
    return cast(ServeState, app.extensions[STATE_KEY])


class LabHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, with the gate in front of every route and the
    completion routes served directly."""

    async def __call__(self, receive: Any, send: Any) -> None:
        state = get_state(self.app)
        exchange = Exchange(cast(dict[str, Any], self.scope), received_at(send))
        gate.prepare(state, exchange)
        refusal = gate.refusal(state, exchange)
        if refusal is not None:
            if is_messages_path(exchange.path):
                refusal = anthropic_reply(refusal)  # the Messages API's envelope
            await send_reply(send, refusal, exchange.headers)
            return
        kind = COMPLETION_ROUTES.get(exchange.path)
        if kind is None:
            route = RAW_ROUTES.get(exchange.path)
            if route is None:
                await super().__call__(receive, exchange.wrap(send))  # type: ignore[arg-type]
            elif exchange.method != "POST":
                reply = method_not_allowed_reply(exchange.method, exchange.path, ("POST",))
                if is_messages_path(exchange.path):
                    reply = anthropic_reply(reply)
                await send_reply(send, reply, exchange.headers)
            else:
                await route(state, exchange, receive, send)
            return
        if exchange.method != "POST":
            reply = method_not_allowed_reply(exchange.method, exchange.path, ("POST",))
            await send_reply(send, reply, exchange.headers)
            return
        await complete(state, kind, exchange, receive, send)

    async def handle_request(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, send: Any
    ) -> None:
        async def send_shielding_final(message: Any) -> None:
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        try:
            await super().handle_request(nursery, request, send_shielding_final)
        except HTTPException as exc:
            # Werkzeug refuses some requests while Quart builds the request context, before
            # any error handler exists (a Host it cannot bind, e.g. "." or "a..b": BadHost).
            reply = error_reply(exc, method=request.method, path=request.path)
            with trio.CancelScope(shield=True):
                await send_reply(send, reply)
            nursery.cancel_scope.cancel()


class NoWebSockets:
    """The app's ASGI WebSocket connection: every upgrade is refused (Rule 5)."""

    def __init__(self, app: Any, scope: Any) -> None:
        self.scope = scope

    async def __call__(self, receive: Any, send: Any) -> None:
        message = await receive()
        if message.get("type") != "websocket.connect":
            return
        path = str(self.scope.get("path", ""))
        if "websocket.http.response" not in (self.scope.get("extensions") or {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        reply = websocket_refused_reply(path)
        headers = [(b"content-type", reply.content_type), *reply.headers]
        await send(
            {"type": "websocket.http.response.start", "status": reply.status, "headers": headers}
        )
        await send({"type": "websocket.http.response.body", "body": reply.body, "more_body": False})


class InferenceLabApp(QuartTrio):
    """The serve app's class: a QuartTrio app whose HTTP connections are
    :class:`LabHTTPConnection` and which has no WebSocket endpoint (:class:`NoWebSockets`).
    It offers the transport ``GET /health`` to answer where the request is read, before
    the queue of work (Rule 6)."""

    asgi_http_class = LabHTTPConnection
    asgi_websocket_class = NoWebSockets  # type: ignore[assignment]
    #: The request targets the connection may answer itself (``transport.quick``);
    #: ``create_app`` adds each served model's admission probe (``serve/kv_routes.py``).
    quick_paths = frozenset({HEALTH_PATH.encode()})

    def quick_answer(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
    ) -> QuickReply | None:
        """The whole answer to a quick request (``serve/health.py``), or None when this
        app has no state yet (not started)."""
        if STATE_KEY not in self.extensions:
            return None
        state = get_state(self)
        if path == HEALTH_PATH:
            return health_quick_answer(state, method, path, headers, client)
        return quick_admission(state, method, path, headers, client)

    #: The ``POST`` targets the connection may answer itself: the completion routes'
    #: (refused there, Rule 7) and the side channel's (Rule 8).
    quick_posts = QUICK_POSTS | KV_QUICK_POSTS

    def quick_posting(self, target: bytes) -> bool:
        """Whether a ``POST`` of ``target`` may be answered where it is read now: a
        side-channel call always (Rule 8), a completion request while it may be refused
        (Rule 7)."""
        if STATE_KEY not in self.extensions:
            return False
        return target in KV_QUICK_POSTS or refusing(get_state(self))

    def quick_post(
        self,
        path: str,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
        body: bytes,
    ) -> QuickReply | None:
        """The side channel's answer (Rule 8), or the route's 529 for a completion request
        read whole (Rule 7), or None."""
        if STATE_KEY not in self.extensions:
            return None
        state = get_state(self)
        if path in KV_ROUTES:
            return quick_kv(state, path, headers, client, body)
        return quick_refusal(state, path, headers, client, body)
