"""hypercorn's HTTP/1.1 protocol with a cheaper response start.

hypercorn hands every response start to h11 as a new ``h11.Response``; h11 validates and
normalises its headers, then, choosing the body's framing, rebuilds and re-validates the
whole list once for every framing header it sets (``Content-Length`` cleared,
``Transfer-Encoding: chunked`` set). For the handful of headers a completion stream
carries that is ~50 µs of CPU per response start, ~5-7 % of a request's whole cost when
the server is busy. :class:`LabH11Protocol` writes the same start having validated the
headers once (~20 µs: ``scripts/bench_stack.py``).

Rule 1: a response start takes the short path only where h11's choice is plain: an
        HTTP/1.1 client, a request that is not HEAD or CONNECT, a keep-alive connection
        below hypercorn's request limit, a final status other than 204 and 304, and
        headers that name neither ``Connection`` nor ``Transfer-Encoding``. The body is
        then framed by its ``Content-Length`` when the headers give one, else chunked.
        Anything else, or headers h11 would refuse, goes hypercorn's and h11's own way.
Rule 2: on the short path the headers (the app's, then hypercorn's ``Date`` and
        ``Server``, built once a second) are validated and normalised once, by h11's own
        function; the event h11's state machine records, and the bytes, are what h11
        itself would produce (its own writer writes them): ``tests/test_serve_protocol.py``
        sends the same starts both ways and compares the bytes and the connection's state
        after, then a body and its end. That relies on three private names of h11's
        ``Connection`` (``_process_event``, ``_writer``, ``_cstate``), so
        ``pyproject.toml`` bounds h11.
"""

from __future__ import annotations

import time
from typing import Any

import h11
from h11._headers import Headers, normalize_and_validate
from hypercorn.events import RawData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response
from hypercorn.protocol.h11 import H11Protocol

__all__ = ["LabH11Protocol", "adopt", "server_headers"]

#: Header names that make h11 change the headers or the connection's keep-alive itself.
_H11_DECIDES = frozenset((b"connection", b"transfer-encoding"))
#: Request methods for which h11 frames a response in its own way.
_SPECIAL_METHODS = frozenset((b"HEAD", b"CONNECT"))
_CHUNKED = (b"Transfer-Encoding", b"transfer-encoding", b"chunked")


#: (hypercorn's configuration, the second, its headers for that second normalised).
_server_cache: tuple[Any, int, list[tuple[bytes, bytes, bytes]]] | None = None


def server_headers(config: Any) -> list[tuple[bytes, bytes, bytes]]:
    """hypercorn's own response headers (``Date``, ``Server``, ``Alt-Svc``) for ``config``,
    normalised, built once a second (``Date`` names the second)."""
    global _server_cache
    second = int(time.time())
    cached = _server_cache
    if cached is not None and cached[0] is config and cached[1] == second:
        return cached[2]
    items = normalize_and_validate(config.response_headers("h11"))._full_items
    _server_cache = (config, second, items)
    return items


class LabH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol whose plain response starts skip h11's repeated
    header validation (the module's Rules)."""

    async def stream_send(self, event: StreamEvent) -> None:
        if type(event) is Response:
            try:
                data = self.response_start(event)
            except h11.LocalProtocolError:  # as hypercorn's own send handles it
                if self.connection.their_state != h11.ERROR:
                    raise
                return
            if data is not None:
                await self.send(RawData(data=data))
                return
        await super().stream_send(event)

    def response_start(self, event: Response) -> bytes | None:
        """The bytes of ``event``'s response start, with h11's state moved on as its own
        ``send`` moves it; None, and nothing changed, where the short path does not apply
        (Rule 1)."""
        connection: Any = self.connection
        status = event.status_code
        if (
            type(connection) is not h11.Connection
            or connection.our_state is not h11.SEND_RESPONSE
            or connection.their_http_version != b"1.1"
            or connection._request_method in _SPECIAL_METHODS
            or not connection._cstate.keep_alive
            or not 200 <= status < 600
            or status in (204, 304)
            or self.keep_alive_requests >= self.config.keep_alive_max_requests
        ):
            return None
        try:
            items = normalize_and_validate(event.headers)._full_items
            items = items + server_headers(self.config)
        except h11.LocalProtocolError:
            return None  # h11's own way raises it where hypercorn expects it
        names = {name for _, name, _ in items}
        if not names.isdisjoint(_H11_DECIDES):
            return None
        if b"content-length" not in names:
            items.append(_CHUNKED)  # (a list of this call's own: the sum above)
        response = h11.Response(
            headers=Headers(items),
            status_code=status,
            http_version=b"1.1",
            reason=b"",
            _parsed=True,
        )
        writer = connection._writer
        assert writer is not None  # (SEND_RESPONSE has one)
        try:
            connection._process_event(h11.SERVER, response)
            data: list[bytes] = []
            writer(response, data.append)
        except BaseException:
            connection._process_error(h11.SERVER)
            raise
        return b"".join(data)


def adopt(protocol: Any) -> None:
    """Make ``protocol`` (the HTTP/1.1 protocol that hypercorn's ``ProtocolWrapper`` has
    just built for a connection) a :class:`LabH11Protocol`; any other protocol (HTTP/2) is
    left as it is. The subclass adds no state, so the switch is only of methods."""
    if type(protocol) is H11Protocol:
        protocol.__class__ = LabH11Protocol
