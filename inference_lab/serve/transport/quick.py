"""Requests answered by the connection's own reading task, before the queue of work.

Under load a request waits for the event loop to come round to it once per scheduling
point on its path: hypercorn starts a task for it, the app awaits its way through routing,
the response start and its body. A liveness probe (``GET /health``) behind 128 busy
streams then answers in tens of milliseconds though its answer costs microseconds. An app
may instead have a few requests answered where their bytes are read.

Rule 1: an app offers ``quick_paths`` (request targets, bytes) and ``quick_answer(method,
        path, headers, client) -> QuickReply | None`` (:class:`QuickAnswers`); the
        connection server finds them on the ASGI app hypercorn wraps. A request is offered
        only when one read brought it whole and nothing else (no pipelined request after
        it), on an idle HTTP/1.1 connection (h11 idle both ways, no request in progress,
        nothing buffered), as an HTTP/1.1 ``GET`` of one of those targets without a body
        (as h11 reads it), ``Upgrade`` or ``Expect``. Anything else, or a None answer,
        goes hypercorn's way unchanged.
Rule 2: the answer is framed by h11 (a connection of its own that parsed the request) with
        hypercorn's ``date`` and ``server`` headers after the app's, and written by the
        reading task with no scheduling point when the socket takes it (connection Rule 4):
        no task is started, nothing waits behind the app's other work. hypercorn's h11
        connection never sees the exchange, so it stays idle; the idle timer restarts as
        after any request. A request with ``Connection: close`` (a kubelet's probe sends
        one) is answered with ``connection: close`` and the connection is then closed as
        hypercorn closes one.

Who calls this: :meth:`LabTCPServer._read_data` (``connection.py``), for every read.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import h11
from hypercorn.protocol.h11 import H11Protocol

__all__ = ["QuickAnswers", "QuickBytes", "QuickReply", "quick_answers", "quick_reply_bytes"]

#: Request headers that keep a request off the quick path (Rule 1).
_REFUSED_HEADERS = (b"upgrade", b"expect")


@attrs.frozen
class QuickReply:
    """A whole answer: status, headers (``content-type`` and ``content-length`` included)
    and body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class QuickAnswers(Protocol):
    """What an app offers for Rule 1."""

    quick_paths: frozenset[bytes]

    def quick_answer(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
    ) -> QuickReply | None: ...


def quick_answers(app: Any) -> QuickAnswers | None:
    """The app behind hypercorn's wrapper ``app`` when it offers quick answers."""
    inner = getattr(app, "app", None)
    if isinstance(getattr(inner, "quick_paths", None), frozenset) and callable(
        getattr(inner, "quick_answer", None)
    ):
        return inner
    return None


def _idle_h11(wrapper: Any) -> bool:
    """Whether hypercorn's protocol is HTTP/1.1 with no request in progress and nothing
    buffered."""
    protocol = getattr(wrapper, "protocol", None)
    if not isinstance(protocol, H11Protocol) or protocol.stream is not None:
        return False
    conn = protocol.connection
    return (
        isinstance(conn, h11.Connection)
        and conn.our_state is h11.IDLE
        and conn.their_state is h11.IDLE
        and not conn.trailing_data[0]
    )


@attrs.frozen
class QuickBytes:
    """The bytes of a quick answer, and whether the connection closes after them."""

    data: bytes
    close: bool


def quick_reply_bytes(
    app: QuickAnswers, wrapper: Any, config: Any, data: bytes
) -> QuickBytes | None:
    """The answer to ``data`` (one read) under Rule 1, or None when it is not a quick
    request (``wrapper``: hypercorn's protocol wrapper; ``config``: its config)."""
    if not data.startswith(b"GET ") or data.split(b" ", 2)[1] not in app.quick_paths:
        return None
    if not _idle_h11(wrapper):
        return None
    conn = h11.Connection(h11.SERVER)
    try:
        conn.receive_data(data)
        request = conn.next_event()
        if not isinstance(request, h11.Request) or request.http_version != b"1.1":
            return None
        if not isinstance(conn.next_event(), h11.EndOfMessage):  # a body follows
            return None
        if conn.next_event() is not h11.NEED_DATA or conn.trailing_data[0]:
            return None  # a pipelined request follows
    except h11.RemoteProtocolError:
        return None
    headers = [(bytes(k), bytes(v)) for k, v in request.headers]
    if any(name in _REFUSED_HEADERS for name, _ in headers):
        return None
    client = getattr(wrapper.protocol, "client", None)
    reply = app.quick_answer("GET", request.target.decode("latin-1"), headers, client)
    if reply is None:
        return None
    response = h11.Response(
        status_code=reply.status,
        headers=[*reply.headers, *config.response_headers("h11")],
        reason=b"",
    )
    parts = (response, h11.Data(data=reply.body), h11.EndOfMessage())
    payload = b"".join(conn.send(event) or b"" for event in parts)
    return QuickBytes(payload, conn.our_state is h11.MUST_CLOSE)
