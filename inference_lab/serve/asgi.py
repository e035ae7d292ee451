"""The app's ASGI connection: where every HTTP request enters, and two stack fixes.

Rule 1: a request's arrival is the moment the server received it (:func:`received_at`):
        under hypercorn's trio worker, when the socket read that brought the request in
        returned (:func:`install_receipt_hook` notes it per connection), else hypercorn's
        own receipt time, else the start of the ASGI call.
Rule 2: every request passes :mod:`inference_lab.serve.gate` first (once a shutdown has
        begun, every request is refused there with a 503); then ``POST`` on a
        completion path goes straight to :func:`inference_lab.serve.completions.complete`,
        any other method on those paths is a 405, and every other request is handed to
        Quart (with the exchange's headers added to its response).
Rule 3: the final ``http.response.body`` of a Quart route is shielded from cancellation
        (hypercorn issue #330: quart-trio cancels the request scope when hypercorn reports
        the disconnect that its own end-of-response handling emits; a cancellation landing
        inside that send left ``Connection: close`` sockets open and keep-alive timers
        unarmed). The completion routes shield their own final sends.
Rule 4: a request Werkzeug refuses before Quart's error handlers exist (a ``Host`` it
        cannot bind) is answered with its error envelope too, never a bare 500.
"""

from __future__ import annotations

import fcntl
import math
import struct
import termios
import time
from typing import Any, cast

import trio
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from inference_lab.serve import gate
from inference_lab.serve.completions import COMPLETION_ROUTES, complete
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.responses import (
    error_reply,
    method_not_allowed_reply,
    send_reply,
    shutting_down_reply,
)
from inference_lab.serve.state import ServeState

__all__ = [
    "InferenceLabApp",
    "LabHTTPConnection",
    "ReceiptStream",
    "STATE_KEY",
    "get_state",
    "install_receipt_hook",
    "received_at",
]

#: Where an app keeps its :class:`ServeState` (``app.extensions[STATE_KEY]``).
STATE_KEY = "inference_lab"
#: Seconds beyond which a server's own receipt time is not believed (a clock step).
MAX_RECEIPT_AGE = 1.0


def get_state(app: Any) -> ServeState:
    """The :class:`ServeState` of an app made by ``create_app``."""
    return cast(ServeState, app.extensions[STATE_KEY])


class ReceiptStream:
    """A connection's trio stream that notes when the server had each read's bytes.

    ``received`` is the trio time at which the latest ``receive_some`` returned data (or
    the end of the stream) -- except for a connection's first read when its bytes were
    already waiting in the kernel when the server took the connection up
    (:meth:`note_waiting`): then it is that moment, before the server's own set-up of
    the connection. Everything else is the wrapped stream's.
    """

    __slots__ = ("_stream", "received", "_waiting_since")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.received = -math.inf
        self._waiting_since: float | None = None

    def note_waiting(self) -> None:
        """If bytes are waiting on the connection now, the first read's bytes were there
        at this moment (one ``FIONREAD``; nothing is noted when it cannot be asked)."""
        try:
            fd = self._stream.socket.fileno()
            waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):
            return
        if waiting > 0:
            self._waiting_since = trio.current_time()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data: bytes | bytearray = await self._stream.receive_some(max_bytes)
        since, self._waiting_since = self._waiting_since, None
        self.received = trio.current_time() if since is None else since
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class ReceiptTCPServer(TCPServer):
    """hypercorn's per-connection server, reading through a :class:`ReceiptStream`."""

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        receipt = ReceiptStream(stream)
        receipt.note_waiting()
        super().__init__(app, config, context, state, receipt)  # type: ignore[arg-type]


def install_receipt_hook() -> bool:
    """Have hypercorn's trio worker serve each connection it accepts from then on over a
    :class:`ReceiptStream` (idempotent; called by ``create_app``). It builds one
    ``TCPServer(app, config, context, state, stream)`` per connection, looking the class
    up in ``hypercorn.trio.run`` when it starts serving; the hook puts
    :class:`ReceiptTCPServer` there. False (and nothing changed) when that name is not
    hypercorn's own class: another hook is in place, or hypercorn changed."""
    current = getattr(hypercorn_run, "TCPServer", None)
    if current is ReceiptTCPServer:
        return True
    if current is not TCPServer:
        return False
    hypercorn_run.TCPServer = ReceiptTCPServer  # type: ignore[attr-defined]
    return True


def received_at(send: Any) -> float:
    """The trio time at which the server received the request that ``send`` answers.

    hypercorn's ``send`` is a bound method of its per-request stream, which notes the
    wall-clock time (``time.time()``) at which it parsed the request, before it built the
    scope and started the app (``start_time``). Earlier still, the socket read that
    brought the request in returned: with :func:`install_receipt_hook` the connection's
    stream notes that (the chain is request stream -> ``send`` of the HTTP/1.1 protocol
    -> ``send`` of the connection server -> its ``stream``). The read is used when it came
    before the parse (a body read later, or a read with no request, leaves the parse
    time); that is ~0.3-0.5 ms of the server's own work earlier than the parse, and the
    parse ~0.2-0.3 ms earlier than the ASGI call. Any other server (or a test client)
    gives no such time: then it is now.
    """
    now = trio.current_time()
    request_stream = getattr(send, "__self__", None)
    started = getattr(request_stream, "start_time", None)
    if type(started) is not float:
        return now
    age = time.time() - started
    if not 0.0 <= age < MAX_RECEIPT_AGE:
        return now
    parsed = now - age
    protocol = getattr(getattr(request_stream, "send", None), "__self__", None)
    server = getattr(getattr(protocol, "send", None), "__self__", None)
    read = getattr(getattr(server, "stream", None), "received", None)
    if type(read) is float and parsed - MAX_RECEIPT_AGE < read <= parsed:
        return read
    return parsed


class LabHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, with the gate in front of every route and the
    completion routes served directly."""

    async def __call__(self, receive: Any, send: Any) -> None:
        state = get_state(self.app)
        exchange = Exchange(cast(dict[str, Any], self.scope), received_at(send))
        gate.prepare(state, exchange)
        refusal = shutting_down_reply() if state.draining else gate.check(state, exchange)
        if refusal is not None:
            await send_reply(send, refusal, exchange.headers)
            return
        kind = COMPLETION_ROUTES.get(exchange.path)
        if kind is None:
            await super().__call__(receive, exchange.wrap(send))  # type: ignore[arg-type]
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


class InferenceLabApp(QuartTrio):
    """The serve app's class: a QuartTrio app whose HTTP connections are
    :class:`LabHTTPConnection`."""

    asgi_http_class = LabHTTPConnection
