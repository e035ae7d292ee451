"""Every HTTP answer that is not a successful completion: errors map to HTTP here only.

Rule 1: :func:`error_reply` is the one mapping from an exception to a status, headers and
        an OpenAI error envelope; the ASGI connection (completions), the Quart routes and
        the error handlers all call it. The 529 body is the one exception to the
        envelope's shape (no ``param``), as refusal-aware clients expect.
Rule 2: a :class:`Reply` is complete before anything is sent: a refusal is answered with
        its status and body before any response starts, never inside a 200 stream.
Rule 3: failures after a response has started are frames, not statuses: a stream whose
        engine failed ends with :func:`stream_failure_frames`; a non-streaming request
        whose engine failed gets :func:`engine_failed_reply`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from werkzeug.exceptions import BadHost, HTTPException, MethodNotAllowed

from inference_lab.api.encoding import StreamEncoder
from inference_lab.api.requests import MAX_BODY_BYTES
from inference_lab.errors import (
    MAX_ECHO_CHARS,
    ApiError,
    EngineSleeping,
    EngineUnavailable,
    QueueFull,
    error_body,
    truncate_echo,
)
from inference_lab.jsonbytes import dumps
from inference_lab.serve.exchange import Send
from inference_lab.serve.transport import one_write

__all__ = [
    "send_reply",
    "JSON",
    "RETRY_AFTER_UNAVAILABLE",
    "SHUTDOWN_MESSAGE",
    "STREAM_HEADERS",
    "Reply",
    "api_key_reply",
    "body_timeout_reply",
    "body_too_fragmented_reply",
    "body_too_large_reply",
    "control_forbidden_reply",
    "control_unauthorized_reply",
    "engine_failed_reply",
    "error_reply",
    "json_reply",
    "method_not_allowed_reply",
    "preflight_reply",
    "retry_after_header",
    "route_not_found_reply",
    "shutting_down_reply",
    "stream_failure_frames",
    "stream_shutdown_frames",
    "unsupported_media_type_reply",
    "websocket_refused_reply",
]

JSON = b"application/json"
#: A preflight's allowed request headers when the list it asked for is too long to echo:
#: the API's own, and any other (``*``, which never covers ``authorization``).
ALLOW_HEADERS = b"authorization, content-type, x-request-id, *"
#: The headers of every event-stream response's start (before the exchange's own).
STREAM_HEADERS = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))
_CLOSE = ((b"connection", b"close"),)
Headers = tuple[tuple[bytes, bytes], ...]


@attrs.frozen
class Reply:
    """A whole response: status, body, and headers beyond ``content-type`` and
    ``content-length`` (which the sender adds)."""

    status: int
    body: bytes
    headers: Headers = ()
    content_type: bytes = JSON

    def header_list(self, extra: Sequence[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
        """The ASGI header list of this reply, ``extra`` appended."""
        return [
            (b"content-type", self.content_type),
            (b"content-length", str(len(self.body)).encode()),
            *self.headers,
            *extra,
        ]


def json_reply(value: Any, status: int = 200) -> Reply:
    return Reply(status, dumps(value))


def _envelope(status: int, message: str, type_: str, code: str, param: str | None) -> Reply:
    return Reply(status, error_body(message, type_, code, param))


#: ``Retry-After`` (seconds) of a 503: a model whose engine stopped does not restart in
#: this process, so a retry is for a restarted server or another replica behind a gateway.
RETRY_AFTER_UNAVAILABLE = 10


def retry_after_header(seconds: int) -> tuple[bytes, bytes]:
    """``Retry-After: <seconds>``, an integer >= 1 (every 529 and 503 carries one)."""
    return (b"retry-after", str(max(1, seconds)).encode())


def error_reply(
    exc: BaseException,
    *,
    method: str = "",
    path: str = "",
    retry_after: int | None = None,
    should_retry_header: bool = True,
) -> Reply:
    """The answer to ``exc``, raised while handling ``method path`` before any response
    started. Unknown exceptions are a 500 ``internal_error`` naming only their type.

    A 529 carries ``Retry-After`` from the refusal's own estimate
    (:meth:`ModelRuntime.retry_after`) and, unless ``should_retry_header`` is False,
    ``x-should-retry: false``; a 503 carries ``Retry-After: retry_after``, by default
    :data:`RETRY_AFTER_UNAVAILABLE`."""
    if isinstance(exc, ApiError):
        return Reply(exc.status, exc.body())
    if isinstance(exc, QueueFull):
        body = dumps(
            {"error": {"message": str(exc), "type": "overloaded_error", "code": "queue_saturated"}}
        )
        retry = retry_after_header(exc.retry_after)
        headers = ((b"x-should-retry", b"false"), retry) if should_retry_header else (retry,)
        return Reply(529, body, headers)
    if isinstance(exc, EngineUnavailable):  # (EngineSleeping is one)
        reason = "engine_sleeping" if isinstance(exc, EngineSleeping) else "engine_unavailable"
        reply = _envelope(503, str(exc), "service_unavailable_error", reason, None)
        retry = retry_after_header(retry_after or RETRY_AFTER_UNAVAILABLE)
        return attrs.evolve(reply, headers=(retry,))
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        if code == 404 or 300 <= code < 400:
            # A redirect would be Werkzeug's (slash merging: its Location is built from
            # the client's Host); the app has no route that answers one.
            return route_not_found_reply(method, path)
        if code == 405:
            allowed = exc.valid_methods if isinstance(exc, MethodNotAllowed) else None
            return method_not_allowed_reply(method, path, allowed or ())
        if code == 408:
            return body_timeout_reply()
        if isinstance(exc, BadHost):
            message = "The Host header is not a valid host name"
            return _envelope(400, message, "invalid_request_error", "invalid_host", None)
        if code == 413:
            return body_too_large_reply()
        kind = "invalid_request_error" if code < 500 else "server_error"
        name = (exc.name or "error").lower().replace(" ", "_")
        reply = _envelope(code, exc.description or name, kind, name, None)
        if code in (503, 529):
            retry = retry_after_header(retry_after or RETRY_AFTER_UNAVAILABLE)
            reply = attrs.evolve(reply, headers=(retry,))
        return reply
    message = f"Internal server error: {type(exc).__name__}"
    return _envelope(500, message, "server_error", "internal_error", None)


def route_not_found_reply(method: str, path: str) -> Reply:
    """404 ``not_found``: no route answers ``method path`` (the path as the client sent
    it, cut to :data:`MAX_ECHO_CHARS`)."""
    message = f"No route for {truncate_echo(method, 32)} {truncate_echo(path)}"
    return _envelope(404, message, "invalid_request_error", "not_found", None)


def websocket_refused_reply(path: str) -> Reply:
    """404 ``not_found``: a WebSocket upgrade (the server has no WebSocket endpoint)."""
    message = f"No WebSocket endpoint at {truncate_echo(path)}: this server speaks HTTP only"
    return _envelope(404, message, "invalid_request_error", "not_found", None)


def method_not_allowed_reply(method: str, path: str, allowed: Iterable[str]) -> Reply:
    message = f"Method {truncate_echo(method, 32)} not allowed on {truncate_echo(path)}"
    reply = _envelope(405, message, "invalid_request_error", "method_not_allowed", None)
    if allowed:
        reply = attrs.evolve(reply, headers=((b"allow", ", ".join(sorted(allowed)).encode()),))
    return reply


def body_too_large_reply() -> Reply:
    message = f"Request body exceeds {MAX_BODY_BYTES} bytes"
    return _envelope(413, message, "invalid_request_error", "request_too_large", None)


def body_too_fragmented_reply(pieces: int) -> Reply:
    """413 ``request_too_fragmented``: the body came in more than ``pieces`` pieces (a
    body in tiny chunks costs CPU per chunk). The connection is closed."""
    message = f"Request body arrived in more than {pieces} pieces; send it in larger writes"
    reply = _envelope(413, message, "invalid_request_error", "request_too_fragmented", None)
    return attrs.evolve(reply, headers=_CLOSE)


def body_timeout_reply(seconds: float | None = None) -> Reply:
    """408 ``request_timeout``: the body did not arrive within the body deadline. The
    connection is closed (the rest of the body would otherwise be read as a request)."""
    within = f" within {seconds:g} s" if seconds is not None else " in time"
    message = f"The request body did not arrive{within}"
    reply = _envelope(408, message, "invalid_request_error", "request_timeout", None)
    return attrs.evolve(reply, headers=_CLOSE)


def unsupported_media_type_reply(content_type: bytes | None) -> Reply:
    """415 ``unsupported_media_type``: a POST body must be declared ``application/json``
    (so that a browser cannot send one without a CORS preflight)."""
    if content_type is None:
        got = "no Content-Type"
    else:
        got = "Content-Type " + truncate_echo(content_type.decode("latin-1"), 64)
    message = f"Request body must be sent as Content-Type: application/json, got {got}"
    return _envelope(415, message, "invalid_request_error", "unsupported_media_type", None)


def control_unauthorized_reply() -> Reply:
    """401: a ``/control/*`` request without ``Authorization: Bearer`` credentials while
    the server has a control token."""
    message = "The control endpoints require an 'Authorization: Bearer <control token>' header"
    reply = _envelope(401, message, "authentication_error", "missing_control_token", None)
    return attrs.evolve(reply, headers=((b"www-authenticate", b'Bearer realm="control"'),))


def control_forbidden_reply(message: str) -> Reply:
    """403: a ``/control/*`` request the control plane refuses (a wrong token, or a
    non-loopback client or Host while the server has no control token)."""
    return _envelope(403, message, "permission_error", "control_forbidden", None)


#: The error frame of a stream still live when a shutdown's grace period ends.
SHUTDOWN_MESSAGE = "The server is shutting down: this request was ended before it finished."


def shutting_down_reply(
    message: str = "The server is shutting down and accepts no new requests",
) -> Reply:
    """503 ``server_shutting_down`` with ``Connection: close``: the server has been told to
    stop and admits nothing more (with :data:`SHUTDOWN_MESSAGE`: the answer to a
    non-streaming request still live when the shutdown's grace period ends)."""
    reply = _envelope(
        503,
        message,
        "service_unavailable_error",
        "server_shutting_down",
        None,
    )
    return attrs.evolve(reply, headers=(*_CLOSE, retry_after_header(RETRY_AFTER_UNAVAILABLE)))


def api_key_reply(provided: bool) -> Reply:
    """401 ``invalid_api_key``: a ``/v1/*`` request without the server's API key
    (``--api-key``) as ``Authorization: Bearer <key>``. The key is never echoed."""
    if provided:
        message = "Incorrect API key provided."
    else:
        message = (
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    reply = _envelope(401, message, "invalid_request_error", "invalid_api_key", None)
    return attrs.evolve(reply, headers=((b"www-authenticate", b"Bearer"),))


#: How long a browser may cache a preflight's answer (``Access-Control-Max-Age``).
PREFLIGHT_MAX_AGE = b"600"


def preflight_reply(request_headers: bytes | None) -> Reply:
    """200 to a CORS preflight from an allowed origin (the gate adds the
    ``Access-Control-Allow-Origin`` itself): the methods the API answers, the request
    headers the browser asked for (a list longer than :data:`MAX_ECHO_CHARS` is not
    echoed: :data:`ALLOW_HEADERS` instead), and how long to cache that."""
    headers = [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-max-age", PREFLIGHT_MAX_AGE),
    ]
    if request_headers:
        echo = request_headers if len(request_headers) <= MAX_ECHO_CHARS else ALLOW_HEADERS
        headers.append((b"access-control-allow-headers", echo))
    return Reply(200, b"", tuple(headers), content_type=b"text/plain")


def engine_failed_reply(message: str) -> Reply:
    """A non-streaming request whose engine failed (or stopped) before it finished."""
    return _envelope(500, message, "server_error", "engine_failed", None)


def stream_failure_frames(message: str) -> bytes:
    """The frames that end a stream whose engine failed: the error frame, then ``[DONE]``."""
    return StreamEncoder.failure(message)


def stream_shutdown_frames() -> bytes:
    """The frames that end a stream still live when a shutdown's grace period ends: an
    error frame naming the shutdown (503's type and code), then ``[DONE]``."""
    body = error_body(SHUTDOWN_MESSAGE, "service_unavailable_error", "server_shutting_down", None)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


async def send_reply(send: Send, reply: Reply, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Send ``reply`` on ASGI ``send``, ``headers`` added: the start, then the body, which
    ends the response, in one socket write where the connection allows it
    (:func:`~inference_lab.serve.transport.one_write`). Every whole reply the app sends
    outside Quart goes through it."""
    headers = reply.header_list(headers)
    async with one_write(send):
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})
