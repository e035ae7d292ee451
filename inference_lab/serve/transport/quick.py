"""Requests answered by the connection's own reading task, before the queue of work.

Under load a request waits for the event loop to come round to it once per scheduling
point on its path: hypercorn starts a task for it, the app awaits its way through routing,
the response start and its body. A liveness probe (``GET /health``) behind 128 busy
streams then answers in tens of milliseconds though its answer costs microseconds. An app
may instead have a few requests answered where their bytes are read.

Rule 1: an app offers ``quick_paths`` (request targets, bytes) and ``quick_answer(method,
        path, headers, client) -> QuickReply | None`` (:class:`QuickAnswers`); it may also
        offer ``quick_posts`` (targets), ``quick_posting(target) -> bool`` and
        ``quick_post(path, headers, client, body) -> QuickReply | None``
        (:class:`QuickPosts`). The connection
        server finds them on the ASGI app hypercorn wraps. A request is offered only when
        one read brought it whole and nothing else (no pipelined request after it), on an
        idle HTTP/1.1 connection (h11 idle both ways, no request in progress, nothing
        buffered), without ``Upgrade`` or ``Expect``: an HTTP/1.1 ``GET`` of a quick path
        without a body (as h11 reads it), or a ``POST`` of a quick post target, its body
        whole, while ``quick_posting(target)`` says so (asked before anything is parsed). Anything
        else, or a None answer, goes hypercorn's way unchanged.
Rule 2: the answer is framed by h11 (a connection of its own that parsed the request) with
        hypercorn's ``date`` and ``server`` headers after the app's, and written by the
        reading task with no scheduling point when the socket takes it (connection Rule 4):
        no task is started, nothing waits behind the app's other work. hypercorn's h11
        connection never sees the exchange, so it stays idle; the idle timer restarts as
        after any request. A request with ``Connection: close`` (a kubelet's probe sends
        one) is answered with ``connection: close`` and the connection is then closed as
        hypercorn closes one.
Rule 3: an app's quick answer that raises is no answer: the request goes hypercorn's way,
        so the app answers it as it answers any request (its own error replies and
        logging), and the exception is logged at debug level. A defect of the quick path
        never drops a connection or leaves a client without an answer.

Who calls this: :meth:`LabTCPServer._read_data` (``connection.py``), for every read.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import attrs
import h11
from hypercorn.protocol.h11 import H11Protocol

_log = logging.getLogger(__name__)

__all__ = [
    "QuickAnswers",
    "QuickBytes",
    "QuickPosts",
    "QuickReply",
    "quick_answers",
    "quick_reply_bytes",
]

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


class QuickPosts(QuickAnswers, Protocol):
    """What an app that also answers some ``POST`` requests offers (Rule 1)."""

    quick_posts: frozenset[bytes]

    def quick_posting(self, target: bytes) -> bool: ...

    def quick_post(
        self,
        path: str,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
        body: bytes,
    ) -> QuickReply | None: ...


def quick_answers(app: Any) -> QuickAnswers | None:
    """The app behind hypercorn's wrapper ``app`` when it offers quick answers."""
    inner = getattr(app, "app", None)
    if isinstance(getattr(inner, "quick_paths", None), frozenset) and callable(
        getattr(inner, "quick_answer", None)
    ):
        return inner
    return None


def _posts(app: QuickAnswers) -> QuickPosts | None:
    if isinstance(getattr(app, "quick_posts", None), frozenset) and callable(
        getattr(app, "quick_post", None)
    ):
        return app  # type: ignore[return-value]
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


def _offered(app: QuickAnswers, data: bytes) -> str | None:
    """The method of a request ``data`` may be offered under Rule 1, from its first line
    alone; None when it is not."""
    if data.startswith(b"GET "):
        return "GET" if data.split(b" ", 2)[1] in app.quick_paths else None
    if data.startswith(b"POST "):
        posts = _posts(app)
        target = data.split(b" ", 2)[1]
        if posts is not None and target in posts.quick_posts:
            return "POST" if posts.quick_posting(target) else None
    return None


def _one_request(conn: h11.Connection, data: bytes) -> tuple[h11.Request, bytes] | None:
    """The request ``data`` holds whole and alone, read by ``conn``, and its body; None
    when it is not one whole HTTP/1.1 request with nothing after it."""
    try:
        conn.receive_data(data)
        request = conn.next_event()
        if not isinstance(request, h11.Request) or request.http_version != b"1.1":
            return None
        body: list[bytes] = []
        event = conn.next_event()
        while isinstance(event, h11.Data):
            body.append(bytes(event.data))
            event = conn.next_event()
        if not isinstance(event, h11.EndOfMessage):  # the body is not whole
            return None
        if conn.next_event() is not h11.NEED_DATA or conn.trailing_data[0]:
            return None  # a pipelined request follows
    except h11.RemoteProtocolError:
        return None
    return request, b"".join(body)


def quick_reply_bytes(
    app: QuickAnswers, wrapper: Any, config: Any, data: bytes
) -> QuickBytes | None:
    """The answer to ``data`` (one read) under Rule 1, or None when it is not a quick
    request (``wrapper``: hypercorn's protocol wrapper; ``config``: its config)."""
    method = _offered(app, data)
    if method is None or not _idle_h11(wrapper):
        return None
    conn = h11.Connection(h11.SERVER)
    read = _one_request(conn, data)
    if read is None:
        return None
    request, body = read
    headers = [(bytes(k), bytes(v)) for k, v in request.headers]
    if any(name in _REFUSED_HEADERS for name, _ in headers):
        return None
    client = getattr(wrapper.protocol, "client", None)
    target = request.target.decode("latin-1")
    try:
        if method == "GET":
            reply = None if body else app.quick_answer("GET", target, headers, client)
        else:
            reply = _posts(app).quick_post(target, headers, client, body)  # type: ignore[union-attr]
    except Exception:  # Rule 3: the app answers it its own way
        _log.debug(
            "the quick answer to %s %s failed; the app answers it", method, target, exc_info=True
        )
        return None
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
