"""A minimal HTTP/1.1 client: h11 over a trio byte stream, with keep-alive connection reuse.

Only what the load generator needs: ``POST`` a small body, read the status and headers,
then read the body either whole or chunk by chunk as it arrives (server-sent events).

The byte stream is a ``Transport`` from the pool's ``connect`` function: ``connect_tcp``
(trio sockets) by default; tests pass one that returns in-memory streams, so the whole
client runs on ``trio.testing.MockClock`` without a socket.

Rule 1: a pool connects only to the one origin (host, port) it was built with. Nothing here
  follows redirects or resolves another address: the load generator's promise that it never
  sends to an address it was not given rests on this.
Rule 2: a connection goes back to the pool only when h11 says both sides are ``DONE`` (the
  response was read to its end and the server did not ask to close); anything else is
  closed.
Rule 3: closing is synchronous (``Transport.close``), so cleanup code that cannot await — the
  ``finally`` of a cancelled request — can always release its connection.
Rule 4: every network or protocol failure surfaces as ``ConnectionFailed``, with the
  original exception chained; callers never see ``OSError`` or ``h11`` errors directly.
Rule 5: a connection notes when its latest request went out (``sent_at``: just before its
  bytes are handed to the transport) and when the bytes of its latest read arrived
  (``received_at``: the kernel's receive timestamp where the transport has one,
  :mod:`inference_lab.socket_stamps`, else when the read returned), so a latency measured
  from the two counts neither the client's own encoding nor its own wake-up.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs
import h11
import trio

from inference_lab.socket_stamps import enable_receive_timestamps, receive_stamped

__all__ = [
    "Connect",
    "Connection",
    "ConnectionFailed",
    "ConnectionPool",
    "Origin",
    "PoolStatistics",
    "TCPTransport",
    "Transport",
    "connect_tcp",
    "connect_tcp_unstamped",
    "parse_base_url",
]

RECEIVE_SIZE = 65536
"""Bytes asked of the socket per read: large reads mean fewer wake-ups per token."""

_NETWORK_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


class ConnectionFailed(Exception):
    """Raised by ``Connection``/``ConnectionPool`` when the connection cannot carry the exchange:
    connect refused, reset, EOF mid-response, or a protocol violation by the server. The
    caller records a connection error and closes the connection (the pool will not reuse it).
    """


@attrs.frozen
class Origin:
    """Where to connect, and the path prefix every request target starts with."""

    host: str
    port: int
    base_path: str = ""

    @property
    def authority(self) -> str:
        """The ``Host`` header value."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"http://{self.authority}{self.base_path}"


def parse_base_url(url: str) -> Origin:
    """Parse ``http://host[:port][/prefix]``; raise ``ValueError`` with a one-line message.

    Only plain ``http`` is supported (the simulator serves no TLS). A trailing ``/`` is
    dropped from the prefix; queries and fragments are refused rather than ignored.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"--url must start with http:// (got {url!r})")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"--url must be http://host[:port][/path] (got {url!r})")
    host = parts.hostname
    if not host:
        raise ValueError(f"--url has no host (got {url!r})")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"--url has an invalid port (got {url!r})") from None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"--url has an invalid host (got {url!r})") from None
    return Origin(host=host, port=port, base_path=parts.path.rstrip("/"))


class Transport(Protocol):
    """The byte stream under one ``Connection``, as a ``Connect`` function returns it."""

    async def send_all(self, data: bytes) -> None:
        """Send every byte (trio ``Stream.send_all``); OSError or a trio resource error if the
        connection is broken."""

    async def receive_some(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes, waiting for at least one; ``b""`` at end of stream."""
        ...

    def is_readable(self) -> bool:
        """True if a read would not wait: data or the end of the stream has arrived. Asked of
        idle connections only, to drop the ones the server closed."""
        ...

    def last_receipt(self) -> float | None:
        """The trio time the kernel received the bytes of the latest read, or None when this
        transport cannot tell (Rule 5)."""
        ...

    def close(self) -> None:
        """Close now: synchronous and idempotent (Rule 3)."""


Connect = Callable[[Origin], Awaitable[Transport]]
"""How a ``ConnectionPool`` opens a connection to its origin; OSError when it cannot."""


class TCPTransport:
    """A ``Transport`` over a trio TCP stream (what ``connect_tcp`` returns)."""

    __slots__ = ("_stream", "_stamped", "_receipt")

    def __init__(self, stream: trio.SocketStream, *, stamped: bool = True) -> None:
        self._stream = stream
        self._stamped = stamped and enable_receive_timestamps(stream.socket)
        self._receipt: float | None = None

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def receive_some(self, max_bytes: int) -> bytes:
        if not self._stamped:
            return await self._stream.receive_some(max_bytes)
        data, self._receipt = await receive_stamped(self._stream.socket, max_bytes)
        return data

    def last_receipt(self) -> float | None:
        return self._receipt

    def is_readable(self) -> bool:
        return self._stream.socket.is_readable()

    def close(self) -> None:
        # The socket's own close is synchronous; trio's ``aclose`` would be a checkpoint.
        self._stream.socket.close()


async def connect_tcp(origin: Origin) -> Transport:
    """The default ``Connect``: a TCP connection to ``origin``'s host and port."""
    return TCPTransport(await trio.open_tcp_stream(origin.host, origin.port))


async def connect_tcp_unstamped(origin: Origin) -> Transport:
    """``connect_tcp`` without the kernel's receive timestamps: a plain ``recv`` per read,
    for a caller that never reads ``received_at`` as a measurement (the proxy relaying a
    backend's stream); ``received_at`` is then when each read returned."""
    return TCPTransport(await trio.open_tcp_stream(origin.host, origin.port), stamped=False)


class Connection:
    """One HTTP/1.1 connection; carries one exchange at a time.

    Created by ``ConnectionPool.acquire``. The caller sends a request, reads the response
    head, reads the body (``receive_body_chunk`` or ``read_body``), then hands it back with
    ``ConnectionPool.release``.
    """

    __slots__ = ("_h11", "_stream", "reused", "sent_at", "received_at")

    def __init__(self, stream: Transport) -> None:
        self._stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self.reused = False
        """True once this connection carried an earlier exchange (keep-alive reuse)."""
        self.sent_at = 0.0
        """The trio time the latest request's bytes were handed to the transport (Rule 5)."""
        self.received_at = 0.0
        """The trio time the bytes of the latest read arrived (Rule 5)."""

    async def send_request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        """Send a complete request (head and body) in one write.

        ``headers`` must include ``host``; ``content-length`` is added here.
        """
        h = self._h11
        try:
            data = h.send(
                h11.Request(
                    method=method,
                    target=target,
                    headers=[*headers, ("content-length", str(len(body)))],
                )
            )
            assert data is not None
            if body:
                data += h.send(h11.Data(data=body)) or b""
            data += h.send(h11.EndOfMessage()) or b""
            self.sent_at = trio.current_time()
            await self._stream.send_all(data)
        except _NETWORK_ERRORS as exc:
            raise ConnectionFailed(_describe(exc)) from exc

    async def receive_response(self) -> h11.Response:
        """Wait for the final response head (1xx responses are skipped)."""
        h = self._h11
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    await self._receive()
                elif type(event) is h11.Response:
                    return event
                elif type(event) is h11.InformationalResponse:
                    continue
                else:
                    raise ConnectionFailed(f"unexpected {type(event).__name__} before response")
        except _NETWORK_ERRORS as exc:
            raise ConnectionFailed(_describe(exc)) from exc

    async def receive_body_chunk(self) -> tuple[bytes, bool]:
        """Return the body bytes that arrived with the next socket read, and whether the
        body ended.

        All body data h11 can decode from one read is joined into one ``bytes``, so a caller
        that timestamps each returned chunk takes the clock once per read, not per frame.
        The data may be empty when the body ends.
        """
        h = self._h11
        parts: list[bytes] = []
        try:
            while True:
                event = h.next_event()
                if type(event) is h11.Data:
                    parts.append(event.data)
                elif event is h11.NEED_DATA:
                    if parts:
                        return b"".join(parts), False
                    await self._receive()
                elif type(event) is h11.EndOfMessage:
                    return b"".join(parts), True
                else:
                    raise ConnectionFailed(f"unexpected {type(event).__name__} in body")
        except _NETWORK_ERRORS as exc:
            raise ConnectionFailed(_describe(exc)) from exc

    async def read_body(self, limit: int) -> bytes:
        """Read the rest of the body; ``ConnectionFailed`` if it exceeds ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0
        while True:
            data, ended = await self.receive_body_chunk()
            parts.append(data)
            size += len(data)
            if size > limit:
                raise ConnectionFailed(f"response body exceeds {limit} bytes")
            if ended:
                return b"".join(parts)

    async def _receive(self) -> None:
        stream = self._stream
        data = await stream.receive_some(RECEIVE_SIZE)
        stamp = stream.last_receipt()
        self.received_at = trio.current_time() if stamp is None else stamp
        # b"" tells h11 the peer closed: it ends a close-delimited body or raises
        # RemoteProtocolError on the next event if the message was incomplete.
        self._h11.receive_data(data)

    def finish_exchange(self) -> bool:
        """Prepare for the next request if the last exchange ended cleanly; return whether
        this connection may be reused (Rule 2)."""
        h = self._h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            return True
        # A connection that never carried a request (the preflight's) is as good as new.
        return h.our_state is h11.IDLE and h.their_state is h11.IDLE

    def is_stale(self) -> bool:
        """True if an idle connection has something to read: the server closed it (EOF) or
        sent bytes nobody asked for. Either way it must not carry another request."""
        return self._stream.is_readable()

    def close(self) -> None:
        """Close the connection now (synchronous, idempotent; Rule 3)."""
        self._stream.close()


def _describe(exc: BaseException) -> str:
    """One line for a network error. trio's connect failure wraps the per-address errors
    in its cause; the first one's errno ("Connection refused") says more."""
    cause = exc.__cause__
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    for err in (cause, exc):
        if isinstance(err, OSError) and err.errno:
            return os.strerror(err.errno)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@attrs.frozen
class PoolStatistics:
    """Returned by ``ConnectionPool.statistics()``."""

    opened: int
    """Connections opened (``connect`` calls that succeeded)."""
    reused: int
    """Requests that went out on a kept-alive connection."""
    idle: int
    """Connections waiting in the pool now."""
    stale_dropped: int
    """Idle connections closed because the server had closed them (or sent unasked bytes)."""


class ConnectionPool:
    """Idle keep-alive connections to one origin (Rule 1), most recently used first.

    ``acquire`` hands out an idle connection or opens a new one with ``connect`` (default
    ``connect_tcp``); ``release`` (synchronous) keeps it for the next request or closes it.
    The pool never limits how many connections are open at once: the caller's concurrency
    limit does.
    """

    def __init__(
        self, origin: Origin, *, connect: Connect = connect_tcp, max_idle: int = 1024
    ) -> None:
        self.origin = origin
        self._connect = connect
        self._max_idle = max_idle
        self._idle: list[Connection] = []
        self._opened = 0
        self._reused = 0
        self._stale = 0

    async def acquire(self) -> Connection:
        """Return a connection ready for a request; ``ConnectionFailed`` if connecting fails."""
        while self._idle:
            conn = self._idle.pop()
            if conn.is_stale():
                self._stale += 1
                conn.close()
                continue
            conn.reused = True
            self._reused += 1
            await trio.lowlevel.checkpoint()
            return conn
        try:
            stream = await self._connect(self.origin)
        except OSError as exc:
            raise ConnectionFailed(f"cannot connect to {self.origin}: {_describe(exc)}") from exc
        self._opened += 1
        return Connection(stream)

    def release(self, conn: Connection) -> None:
        """Keep ``conn`` for reuse if its exchange ended cleanly, else close it."""
        if conn.finish_exchange() and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection (connections in use are closed by their holders)."""
        while self._idle:
            self._idle.pop().close()

    def statistics(self) -> PoolStatistics:
        """Counts since the pool was made; the load generator puts them in its result."""
        return PoolStatistics(
            opened=self._opened,
            reused=self._reused,
            idle=len(self._idle),
            stale_dropped=self._stale,
        )
