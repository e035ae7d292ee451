"""hypercorn's per-connection server, hooked: arrival stamps, single writes, close watch.

hypercorn's trio worker serves each accepted connection with a ``TCPServer``; the app
puts a subclass in its place (:func:`install_connection_hook`, called by ``create_app``,
so under ``inference-lab serve`` and a plain hypercorn launch alike). From a request's
``send`` the chain to it is: hypercorn's per-request stream (``send.__self__``) -> its
``send``, a bound method of the HTTP/1.1 protocol -> the protocol's ``send``, a bound
method of the connection server (:func:`connection_server`). What each hook saves is
measured by ``scripts/bench_transport.py``; the figures are in ``docs/internals.md``
("The transport"). The connection's stream is a :class:`ReceiptStream` (``receipt.py``),
its keep-alive timer an :class:`IdleTimer` (``idle_timer.py``); both are importable here.

Rule 1: a request's arrival is the moment the server received it (:func:`received_at`):
        when the kernel received the bytes that the socket read bringing the request in
        returned (their receive timestamp, where the socket gives one:
        :func:`enable_receive_timestamps`), else when that read returned (the
        connection's :class:`ReceiptStream` notes either), else hypercorn's own receipt
        time (its parse), else the start of the ASGI call.
Rule 2: the bytes of a whole reply (response start, body, end of body) and of a stream's
        last message (its last frames and the chunked terminator) leave in one socket
        write (:meth:`LabTCPServer.one_write`), not one per protocol event.
Rule 3: the keep-alive idle timer is one task per connection sleeping until a deadline
        that the start and end of each request move (:class:`IdleTimer`), not a task
        started for every idle period and cancelled by the next request; an idle
        connection is still closed after ``keep_alive_timeout`` or when the server
        terminates, and the timer ends with the connection's reading. A connection that
        received part of a request head but not all of it within that time is answered
        408 (the OpenAI envelope, ``Connection: close``) before it is closed; an HTTP/2
        (h2c) connection without a stream in progress for that long -- a preface alone,
        or a HEADERS block never ended -- is closed like an idle HTTP/1.1 one.
Rule 4: a write goes to the socket without a scheduling point when the connection's
        send lock is free and the socket's buffer takes the bytes at once (hypercorn's
        ``async with`` on the lock and trio's ``send_all`` cost trips through the
        scheduler per write); the rest of a write the buffer did not take goes under
        the lock, and a busy lock or a cancelled task goes hypercorn's own way.
Rule 5: when a connection ends, the links between its server, hypercorn's protocol and
        the idle timer are dropped, so reference counting frees the connection's objects
        at once: left in their reference cycles they would wait for the cycle collector,
        whose collections stall the whole loop, under a churn of short connections such
        as refused clients.
Rule 6: a request can be told synchronously that its client has gone
        (:meth:`ReceiptStream.watch_close`) rather than by a task of its own waiting for
        hypercorn's ``http.disconnect`` message (a task, a nursery and a cancellation per
        request). The connection's stream tells it: its reading has ended when a read
        returns the end of the stream or fails in any way (closed, reset, cancelled, timed
        out), and hypercorn's reader then stops too.
Rule 7: a streamed response's mid-body chunks can be written pre-framed, straight to the
        connection (:func:`chunk_writer`): hypercorn's request stream and h11 keep no
        state for one, and passing through them costs more than the write itself; the
        response start and the end of the body still pass through them, so their state
        machines see the whole exchange. Such a chunk can also be written synchronously,
        as far as the socket's buffer takes it, by code that cannot await
        (:meth:`ChunkWriter.write_nowait`, under Rule 4's conditions and outside a
        gathered write): the engine's hand-over of tokens.
Rule 8: a connection's reads go without a cancel scope each when no read timeout is
        configured (hypercorn's default; its reader puts one around every read for that
        timeout): at a few hundred requests a second that is a few per cent of the
        server's CPU. With a read timeout, hypercorn's own reader runs.
Rule 9: that reader answers the requests an app offers to answer at once (``GET /health``)
        itself, where their bytes are read, before the queue of work (:mod:`.quick`).
Rule 10: a stream's end may be written the same way (:meth:`ChunkWriter.end_nowait`: the
         last chunk and the chunked terminator in one write); the response is then ended
         through the HTTP stack as usual, and the terminator h11 writes for it is dropped
         once, so the bytes on the wire are h11's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from inference_lab.serve.transport.accept_log import install_accept_log_filter
from inference_lab.serve.transport.idle_timer import IdleTimer
from inference_lab.serve.transport.quick import quick_answers, quick_reply_bytes
from inference_lab.serve.transport.receipt import ReceiptStream
from inference_lab.socket_stamps import (
    MAX_RECEIPT_AGE,
    enable_receive_timestamps,
    receives_timestamps,
)

__all__ = [
    "ChunkWriter",
    "CloseWatch",
    "IdleTimer",
    "LabTCPServer",
    "MAX_RECEIPT_AGE",
    "OneWrite",
    "ReceiptStream",
    "chunk_writer",
    "close_watch",
    "connection_server",
    "connection_socket",
    "enable_receive_timestamps",
    "install_connection_hook",
    "local_connection",
    "one_write",
    "received_at",
    "receives_timestamps",
]


class LabTCPServer(TCPServer):
    """hypercorn's per-connection server, reading through a :class:`ReceiptStream` and
    able to gather the writes of several protocol events into one (:meth:`one_write`)."""

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        timer = IdleTimer(self)
        receipt = ReceiptStream(stream, on_end=timer.finish)
        receipt.note_waiting()
        super().__init__(app, config, context, state, receipt)  # type: ignore[arg-type]
        self._receipt = receipt
        self._gathered: list[bytes] | None = None
        #: The chunked terminator of the response in progress is on the wire (Rule 10).
        self._ended_on_wire = False
        self._idle_timer = timer
        self.idle_task = timer  # type: ignore[assignment]

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self._unlink()

    async def _read_data(self) -> None:
        """hypercorn's reader (Rule 8): with no read timeout configured (hypercorn's
        default) each read goes without the cancel scope hypercorn puts around it for
        that timeout; with one, hypercorn's own reader runs."""
        if self.config.read_timeout:
            await super()._read_data()
            return
        receive, handle = self.stream.receive_some, self.protocol.handle
        quick = quick_answers(self.app)  # Rule 9
        while True:
            try:
                data = await receive(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            if quick is not None and data:
                answer = quick_reply_bytes(quick, self.protocol, self.config, bytes(data))
                if answer is not None:
                    await self._write(RawData(data=answer.data))
                    if answer.close:  # as hypercorn ends a Connection: close exchange
                        await self.protocol_send(Closed())
                    else:
                        await self.idle_task.restart(self._task_group, self._idle_timeout)
                    continue
            await handle(RawData(bytes(data)))
            if not data:
                break
        await handle(Closed())

    def _unlink(self) -> None:
        """Drop the links by which the connection's objects refer back to this server
        (the protocol's send callbacks, the idle timer), once hypercorn is done with it
        (Rule 5): reference counting then frees them at once."""
        self.__dict__.pop("protocol", None)
        self.__dict__.pop("_task_group", None)
        self._idle_timer._server = None  # type: ignore[assignment]
        self.idle_task = None  # type: ignore[assignment]

    async def protocol_send(self, event: Event) -> None:
        if self._ended_on_wire and isinstance(event, RawData) and event.data == TERMINATOR:
            self._ended_on_wire = False  # written with the body's last chunk (Rule 10)
            return
        gathered = self._gathered
        if gathered is not None:
            if isinstance(event, RawData):
                gathered.append(event.data)
                return
            await self._flush()  # a close or an idle change: what was written goes first
        if isinstance(event, RawData):
            await self._write(event)
        else:
            await super().protocol_send(event)

    async def _write(self, event: RawData, shielded: bool = False) -> None:
        """hypercorn's write (under the connection's send lock, shielded, a failed write
        reported as the connection's close), without a scheduling point when nobody holds
        the lock and the socket takes the bytes at once (Rule 4); what it does not take is
        sent under the lock as hypercorn does. A cancelled task, or a lock in use, takes
        hypercorn's own path. ``shielded``: the write must happen even in a cancelled
        task (a gathered write's flush)."""
        lock = self.send_lock
        if lock.locked() or (not shielded and trio.current_effective_deadline() == -math.inf):
            if shielded:
                with trio.CancelScope(shield=True):
                    await super().protocol_send(event)
            else:  # a cancelled task raises there, as with hypercorn
                await super().protocol_send(event)
            return
        data = event.data
        try:
            sent = self._receipt.send_nowait(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            sent = -1
        if sent == len(data):
            return
        with trio.CancelScope(shield=True):
            if sent < 0:
                await self.protocol.handle(Closed())
                return
            lock.acquire_nowait()  # free: nothing ran since it was seen free
            try:
                await self.stream.send_all(data[sent:] if sent else data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
            finally:
                lock.release()

    async def _flush(self) -> None:
        gathered, self._gathered = self._gathered, []
        if gathered:
            await self._write(RawData(data=b"".join(gathered)), shielded=True)

    def one_write(self) -> OneWrite:
        """Gather what the protocol writes inside into one socket write at the end (or
        before a close inside); nested uses join the outer one."""
        return OneWrite(self)


class OneWrite:
    """The async context of :meth:`LabTCPServer.one_write` (a class rather than a
    generator-based context manager: a fifth of the cost, on every request's path). With
    no server, a plain pass-through."""

    __slots__ = ("_server", "_outer")

    def __init__(self, server: LabTCPServer | None) -> None:
        self._server = server
        self._outer = True

    async def __aenter__(self) -> None:
        server = self._server
        if server is not None and server._gathered is None:
            server._gathered = []
            self._outer = False

    async def __aexit__(self, *exc_info: object) -> None:
        if self._outer:
            return
        server = self._server
        assert server is not None
        try:
            await server._flush()
        finally:
            server._gathered = None


def install_connection_hook() -> bool:
    """Have hypercorn's trio worker serve each connection it accepts from then on with a
    :class:`LabTCPServer` (idempotent; called by ``create_app``). It builds one
    ``TCPServer(app, config, context, state, stream)`` per connection, looking the class
    up in ``hypercorn.trio.run`` when it starts serving; the hook puts
    :class:`LabTCPServer` there. False (and nothing changed) when that name is not
    hypercorn's own class: another hook is in place, or hypercorn changed. Also quiets the
    accept loop when file descriptors run out (:mod:`.accept_log`)."""
    install_accept_log_filter()
    current = getattr(hypercorn_run, "TCPServer", None)
    if current is LabTCPServer:
        return True
    if current is not TCPServer:
        return False
    hypercorn_run.TCPServer = LabTCPServer  # type: ignore[attr-defined]
    return True


def received_at(send: Any) -> float:
    """The trio time at which the server received the request that ``send`` answers.

    hypercorn's ``send`` is a bound method of its per-request stream, which notes the
    wall-clock time (``time.time()``) at which it parsed the request, before it built the
    scope and started the app (``start_time``). Earlier still, the socket read that
    brought the request in returned: with :func:`install_connection_hook` the connection's
    stream notes that (the chain is request stream -> ``send`` of the HTTP/1.1 protocol
    -> ``send`` of the connection server -> its ``stream``). The read is used when it came
    before the parse (a body read later, or a read with no request, leaves the parse
    time): the server's own work of waking, reading and parsing then counts inside the
    request's latency, as it would in a real engine's server. Any other server (or a test
    client) gives no such time: then it is now.
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
    read = getattr(getattr(connection_server(send), "stream", None), "received", None)
    if type(read) is float and parsed - MAX_RECEIPT_AGE < read <= parsed:
        return read
    return parsed


def _hooked_chain(send: Any) -> tuple[Any, Any, LabTCPServer] | None:
    """hypercorn's request stream, HTTP/1.1 protocol and hooked connection server behind
    a request's ``send`` (see the module docstring), or None."""
    request_stream = getattr(send, "__self__", None)
    protocol = getattr(getattr(request_stream, "send", None), "__self__", None)
    server = getattr(getattr(protocol, "send", None), "__self__", None)
    if not isinstance(server, LabTCPServer):
        return None
    return request_stream, protocol, server


def connection_server(send: Any) -> LabTCPServer | None:
    """The hooked connection server behind hypercorn's ``send`` for a request, or None
    (another server, a test client, or the hook not installed)."""
    chain = _hooked_chain(send)
    return None if chain is None else chain[2]


class CloseWatch(Protocol):
    """A connection that tells a request synchronously when its client has gone."""

    def watch_close(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the client has gone; False (nothing registered) when it
        has already gone."""
        ...

    def unwatch_close(self) -> None:
        """Remove the callback."""
        ...


def close_watch(send: Any) -> CloseWatch | None:
    """The stream of the hooked connection behind ``send``, whose ``watch_close`` tells a
    request synchronously that its client has gone (Rule 6); None where ``send`` is not a
    hooked connection's (the caller then waits for ``http.disconnect``)."""
    server = connection_server(send)
    return None if server is None else server._receipt


def connection_socket(send: Any) -> trio.SocketStream | None:
    """The trio socket stream of the TCP connection behind ``send`` (the one hypercorn
    accepted; for a TLS connection, the stream under it), found through the hooked
    connection server; None where there is none (another server, the in-memory client)."""
    server = connection_server(send)
    if server is None:
        return None
    stream = server._receipt.wrapped
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    return stream if isinstance(stream, trio.SocketStream) else None


#: Response headers that fix a body's framing themselves (then it is not chunked).
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))


def chunk_writer(send: Any) -> ChunkWriter | None:
    """For a response whose start has been sent on ``send``: a function that writes one
    mid-body chunk straight to the connection, framed as h11 frames it (HTTP/1.1 chunked:
    the size in hex, CRLF, the data, CRLF), without passing through hypercorn's request
    stream and h11 -- neither changes state for a body chunk of a chunked response
    (Rule 7). It writes nothing once hypercorn has seen the stream close, as hypercorn
    would not. The end of the body still goes through ``send``.

    None where that does not hold: not a hooked connection, a response not yet started,
    not chunked (an HTTP/1.0 client, a start that declares its length or framing), or a
    HEAD request."""
    chain = _hooked_chain(send)
    if chain is None:
        return None
    request_stream, protocol, server = chain
    connection = getattr(protocol, "connection", None)
    response = getattr(request_stream, "response", None)
    scope = getattr(request_stream, "scope", None)
    if (
        type(connection) is not h11.Connection
        or connection.our_state is not h11.SEND_BODY
        or connection.their_http_version != b"1.1"
        or not isinstance(response, dict)
        or not isinstance(scope, dict)
        or scope.get("method") == "HEAD"
        or any(name.lower() in _FRAMING_HEADERS for name, _ in response.get("headers", ()))
    ):
        return None
    return ChunkWriter(request_stream, server)


#: The end of a chunked body without trailers, as h11 writes it.
TERMINATOR = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    """``data`` framed as one HTTP/1.1 chunk, as h11 frames it: the size in hex, CRLF, the
    data, CRLF."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class ChunkWriter:
    """Writes the mid-body chunks of one started, chunked HTTP/1.1 response straight to
    its connection (:func:`chunk_writer`)."""

    __slots__ = ("_request_stream", "_server")

    def __init__(self, request_stream: Any, server: LabTCPServer) -> None:
        self._request_stream = request_stream
        self._server = server

    async def __call__(self, data: bytes) -> None:
        """Write ``data`` as one chunk (nothing for empty data, or once hypercorn has seen
        the stream close)."""
        if data and not self._request_stream.closed:
            await self._server.protocol_send(RawData(data=_chunk(data)))

    async def write_framed(self, framed: bytes) -> None:
        """Write what :meth:`write_nowait` left of its chunk."""
        if framed and not self._request_stream.closed:
            await self._server.protocol_send(RawData(data=framed))

    def ready(self) -> bool:
        """Whether :meth:`write_nowait` may write now: the connection is a plain socket
        stream, nobody holds its send lock and no gathered write is open on it (Rule 2)."""
        server = self._server
        return server._gathered is None and not server.send_lock.locked() and server._receipt.plain

    def end_nowait(self, data: bytes) -> bytes:
        """Write ``data`` as the body's last chunk and the chunked terminator, as
        :meth:`write_nowait` writes (call only when :meth:`ready`); what is left of them,
        for :meth:`write_framed`. The HTTP stack's own terminator, when the response is
        then ended through it, is not written again (Rule 10)."""
        framed = (_chunk(data) if data else b"") + TERMINATOR
        if self._request_stream.closed:
            return b""
        self._server._ended_on_wire = True
        try:
            sent = self._server._receipt.send_nowait(framed)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return framed  # the writer's own write reports the close, hypercorn's way
        return framed[sent:] if sent else framed

    def write_nowait(self, data: bytes) -> bytes:
        """Write ``data`` as one chunk without a scheduling point, as far as the socket's
        buffer takes it: what is left of the framed chunk (b"" when all of it was
        written), for :meth:`write_framed`. Call only when :meth:`ready`."""
        if not data or self._request_stream.closed:
            return b""
        framed = _chunk(data)
        try:
            sent = self._server._receipt.send_nowait(framed)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return framed  # the writer's own write reports the close, hypercorn's way
        return framed[sent:] if sent else framed


def one_write(send: Any) -> OneWrite:
    """What the messages sent on ``send`` inside write to the connection leaves in one
    socket write (Rule 2); a plain pass-through where ``send`` is not hypercorn's on a
    hooked connection."""
    return OneWrite(connection_server(send))


def local_connection(app: Any, config: Any = None) -> tuple[LabTCPServer, trio.SocketStream]:
    """A hooked connection server for the ASGI ``app`` over a local socket pair, not yet
    running (``await server.run()``), and the client's end of the pair (a trio socket
    stream); ``config`` is hypercorn's configuration (default: hypercorn's, no access
    log). For the start-up warm-up, tests and benchmarks: nothing listens."""
    if config is None:
        config = HyperConfig()
        config.accesslog = None
    ours, theirs = trio.socket.socketpair()
    server = LabTCPServer(
        ASGIWrapper(app), config, WorkerContext(None), ConnectionState({}), trio.SocketStream(ours)
    )
    return server, trio.SocketStream(theirs)
