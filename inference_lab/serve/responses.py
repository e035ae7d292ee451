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
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from inference_lab.errors import ApiError, EngineUnavailable, QueueFull, error_body
from inference_lab.jsonbytes import dumps
from inference_lab.openai_api import MAX_BODY_BYTES, StreamEncoder

__all__ = [
    "JSON",
    "Reply",
    "engine_failed_reply",
    "error_reply",
    "json_reply",
    "stream_failure_frames",
]

JSON = b"application/json"
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


def error_reply(exc: BaseException, *, method: str = "", path: str = "") -> Reply:
    """The answer to ``exc``, raised while handling ``method path`` before any response
    started. Unknown exceptions are a 500 ``internal_error`` naming only their type."""
    if isinstance(exc, ApiError):
        return Reply(exc.status, exc.body())
    if isinstance(exc, QueueFull):
        body = dumps(
            {"error": {"message": str(exc), "type": "overloaded_error", "code": "queue_saturated"}}
        )
        return Reply(529, body, ((b"x-should-retry", b"false"),))
    if isinstance(exc, EngineUnavailable):
        return _envelope(503, str(exc), "service_unavailable_error", "engine_unavailable", None)
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        if code == 404:
            message = f"No route for {method} {path}"
            return _envelope(404, message, "invalid_request_error", "not_found", None)
        if code == 405:
            allowed = exc.valid_methods if isinstance(exc, MethodNotAllowed) else None
            return method_not_allowed_reply(method, path, allowed or ())
        if code == 413:
            return body_too_large_reply()
        kind = "invalid_request_error" if code < 500 else "server_error"
        name = (exc.name or "error").lower().replace(" ", "_")
        return _envelope(code, exc.description or name, kind, name, None)
    message = f"Internal server error: {type(exc).__name__}"
    return _envelope(500, message, "server_error", "internal_error", None)


def method_not_allowed_reply(method: str, path: str, allowed: Iterable[str]) -> Reply:
    message = f"Method {method} not allowed on {path}"
    reply = _envelope(405, message, "invalid_request_error", "method_not_allowed", None)
    if allowed:
        reply = attrs.evolve(reply, headers=((b"allow", ", ".join(sorted(allowed)).encode()),))
    return reply


def body_too_large_reply() -> Reply:
    message = f"Request body exceeds {MAX_BODY_BYTES} bytes"
    return _envelope(413, message, "invalid_request_error", "request_too_large", None)


def engine_failed_reply(message: str) -> Reply:
    """A non-streaming request whose engine failed (or stopped) before it finished."""
    return _envelope(500, message, "server_error", "engine_failed", None)


def stream_failure_frames(message: str) -> bytes:
    """The frames that end a stream whose engine failed: the error frame, then ``[DONE]``."""
    return StreamEncoder.failure(message)
