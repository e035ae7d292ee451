"""hypercorn's hooked connection server (inference_lab/serve/transport/connection.py): the
keep-alive idle timer (Rule 3), the writes (Rules 2, 4, 7), the close watch (Rule 6), the
unlinking (Rule 5) and the connection's socket."""

from __future__ import annotations

import gc
import socket
import struct
import weakref
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import ConnectionState

from inference_lab.serve.transport.connection import (
    IdleTimer,
    LabTCPServer,
    ReceiptStream,
    chunk_writer,
    close_watch,
    connection_server,
    connection_socket,
    install_connection_hook,
    local_connection,
    one_write,
)
from tests.conftest import GPT, make_settings
from tests.serve_util import http_request, read_until_eof, running_server
from tests.transport_util import answer_on_local_connection, h11_answers, record_h11_sends


@attrs.define
class FakeServer:
    """What the timer uses of hypercorn's connection server."""

    config: Any
    context: Any
    closes: list[float] = attrs.field(factory=list)
    #: the connection's stream (its count of reads) and protocol (none: not HTTP/2)
    _receipt: Any = attrs.field(factory=lambda: attrs.make_class("R", ["reads"])(0))
    protocol: Any = None

    async def _initiate_server_close(self) -> None:
        self.closes.append(trio.current_time())


def _timer(timeout: float) -> tuple[IdleTimer, FakeServer, trio.Event]:
    terminated = trio.Event()
    server = FakeServer(
        config=attrs.make_class("C", ["keep_alive_timeout"])(timeout),
        context=attrs.make_class("X", ["terminated"])(terminated),
    )
    return IdleTimer(server), server, terminated  # type: ignore[arg-type]


@attrs.define
class Group:
    _nursery: trio.Nursery


async def test_an_idle_connection_is_closed_once_after_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timer, server, _ = _timer(5.0)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await timer.restart(Group(nursery), None)
        await trio.sleep(10)
    assert server.closes == [start + 5.0]


async def test_a_request_stops_the_timer_and_the_next_idle_period_starts_it_anew(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """stop() during a request holds the connection open however long the request
    runs; restart() counts the timeout from the new idle moment, not the first."""
    timer, server, _ = _timer(5.0)
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        await timer.restart(group, None)
        await trio.sleep(4)
        await timer.stop()  # a request began at t=4 ...
        await trio.sleep(100)  # ... and runs for 100 s
        assert server.closes == []
        again = trio.current_time()
        await timer.restart(group, None)  # idle again
        await trio.sleep(3)
        await timer.stop()
        await timer.restart(group, None)  # a short request: idle from t+3
        await trio.sleep(10)
    assert server.closes == [again + 3 + 5.0]


async def test_termination_closes_an_idle_connection_but_not_a_busy_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timer, server, terminated = _timer(5.0)
    async with trio.open_nursery() as nursery:
        group = Group(nursery)
        await timer.restart(group, None)
        await trio.sleep(1)  # the watcher waits on the idle connection ...
        await timer.stop()  # ... which then gets a request
        terminated.set()
        await trio.sleep(50)
        assert server.closes == []  # a request in flight is not cut by the idle timer
        now = trio.current_time()
        await timer.restart(group, None)  # its response done: idle on a terminating server
        await trio.sleep(1)
    assert server.closes == [now]


async def test_finish_ends_the_watcher_without_closing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """When the connection's reading has ended the watcher ends at once (the nursery
    can exit), idle or not, and never closes anything itself."""
    for busy in (False, True):
        timer, server, _ = _timer(5.0)
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                await timer.restart(Group(nursery), None)
                if busy:
                    await timer.stop()
                await trio.sleep(0.5)
                timer.finish()
        assert server.closes == []


async def test_a_keep_alive_connection_serves_a_request_longer_than_the_timeout() -> None:
    """With keep_alive_timeout 1 s, a request that runs for longer than that (its steps
    priced at 20 times the model's) and then another at once, all on one connection: both
    answered; then the idle connection is closed."""
    body = {"model": GPT, "prompt": "x", "max_tokens": 200}
    with trio.fail_after(30):
        async with running_server(make_settings(), keep_alive_timeout=1.0) as (_, port, state):
            state.runtimes[GPT].set_step_time_factor(20.0)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(http_request("POST", "/v1/completions", body))
            started = trio.current_time()
            first = b""
            while b'"finish_reason"' not in first:
                first += await stream.receive_some(65536)
            assert trio.current_time() - started > 1.0  # longer than the idle timeout
            await stream.send_all(http_request("GET", "/health"))
            rest = await read_until_eof(stream)  # the server closes once idle 1 s
            await stream.aclose()
    assert first.startswith(b"HTTP/1.1 200")
    assert rest.startswith(b"HTTP/1.1 200")


async def _connection_server() -> tuple[LabTCPServer, trio.SocketStream]:
    server, client = local_connection(None)
    server.protocol = ProtocolWrapper(  # what TCPServer.run sets up before any write
        server.app,
        server.config,
        server.context,
        None,  # type: ignore[arg-type]
        ConnectionState({}),
        False,
        None,
        None,
        server.protocol_send,
        "http/1.1",
    )
    return server, client


async def test_a_write_waits_for_a_held_send_lock_and_keeps_the_order() -> None:
    """The lock-free fast path is only taken when nobody holds the lock: a write while
    another holds it waits, and the bytes arrive in order."""
    server, client = await _connection_server()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await server.send_lock.acquire()
            nursery.start_soon(server.protocol_send, RawData(data=b"second"))
            await trio.sleep(0.05)
            await server.stream.send_all(b"first ")
            server.send_lock.release()
        await server.protocol_send(RawData(data=b" third"))
        data = b""
        while not data.endswith(b"third"):
            data += await client.receive_some(100)
    assert data == b"first second third"


async def test_a_write_the_socket_takes_at_once_has_no_scheduling_point() -> None:
    """With the send lock free and room in the socket's buffer, a write goes out without
    a trip through the scheduler: no other task runs during it (Rule 4)."""
    server, client = await _connection_server()
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await server.protocol_send(RawData(data=b"at once"))
        assert ran == []  # the write did not yield to the waiting task
    assert ran == ["other"]
    assert await client.receive_some(100) == b"at once"


async def test_what_the_socket_buffer_does_not_take_follows_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write larger than the socket's buffer: the part it takes at once, then the
    rest through ``send_all`` as the reader drains it; every byte arrives, in order,
    before the next write's."""
    server, client = await _connection_server()
    server.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 4096
    rests: list[int] = []
    plain_send_all = trio.SocketStream.send_all

    async def recording_send_all(self: trio.SocketStream, data: Any) -> None:
        rests.append(len(data))
        await plain_send_all(self, data)

    monkeypatch.setattr(trio.SocketStream, "send_all", recording_send_all)
    received = bytearray()

    async def read() -> None:
        while len(received) < len(big) + 4:
            received.extend(await client.receive_some(65536))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await server.protocol_send(RawData(data=big))
            await server.protocol_send(RawData(data=b"tail"))
    assert received == big + b"tail"
    assert len(rests) >= 1 and 0 < rests[0] < len(big)  # a part went at once, the rest after


async def test_a_write_to_a_broken_connection_reports_its_close() -> None:
    """A write the socket refuses (the client has gone) raises nothing to the writer: the
    protocol is told the connection closed, as with hypercorn's own write."""
    server, client = await _connection_server()
    events: list[Any] = []

    async def handle(event: Any) -> None:
        events.append(event)

    server.protocol.handle = handle  # type: ignore[method-assign]
    await client.aclose()
    await server.protocol_send(RawData(data=b"x" * 100))
    assert [type(e).__name__ for e in events] == ["Closed"]
    await server.stream.aclose()
    events.clear()
    await server.protocol_send(RawData(data=b"after close"))  # a closed socket: the same
    assert [type(e).__name__ for e in events] == ["Closed"]


def test_a_stream_that_is_not_a_plain_socket_takes_no_write_at_once() -> None:
    """``send_nowait`` writes only to a plain socket stream; any other stream's writes go
    through its own ``send_all`` (nothing written here)."""
    stream = trio.testing.MemorySendStream()
    assert ReceiptStream(stream).send_nowait(b"data") == 0
    with pytest.raises(trio.WouldBlock):  # nothing was written
        stream.get_data_nowait()


async def test_one_write_gathers_nested_uses_into_one_write_even_on_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the protocol writes inside ``one_write`` leaves in one socket write at its
    end; a nested use joins the outer one; an error inside still writes what was
    gathered, then propagates. Off a hooked connection it passes through."""
    server, client = await _connection_server()
    writes: list[bytes] = []
    plain = ReceiptStream.send_nowait

    def recording(self: ReceiptStream, data: bytes) -> int:
        writes.append(bytes(data))
        return plain(self, data)

    monkeypatch.setattr(ReceiptStream, "send_nowait", recording)
    with pytest.raises(ValueError, match="inside"):
        async with server.one_write():
            await server.protocol_send(RawData(data=b"a"))
            async with server.one_write():
                await server.protocol_send(RawData(data=b"b"))
            assert writes == []
            await server.protocol_send(RawData(data=b"c"))
            raise ValueError("inside")
    assert writes == [b"abc"]
    await server.protocol_send(RawData(data=b"d"))  # not gathered any more
    assert writes == [b"abc", b"d"]
    assert await client.receive_some(100) == b"abcd"

    async def send(message: dict[str, Any]) -> None:
        pass

    async with one_write(send):  # no hooked connection behind it: nothing to gather
        pass


async def test_a_gathered_write_is_flushed_even_in_a_cancelled_task() -> None:
    """What ``one_write`` gathered leaves when it ends although the task was cancelled
    meanwhile (a stream's last frames), also when it must first wait for the send lock."""
    server, client = await _connection_server()
    with trio.CancelScope() as scope:
        async with server.one_write():
            await server.protocol_send(RawData(data=b"gathered"))
            scope.cancel()
    assert await client.receive_some(100) == b"gathered"
    async with trio.open_nursery() as nursery:
        await server.send_lock.acquire()

        async def cancelled_flush() -> None:
            with trio.CancelScope() as inner:
                async with server.one_write():
                    await server.protocol_send(RawData(data=b" second"))
                    inner.cancel()

        nursery.start_soon(cancelled_flush)
        await trio.sleep(0.05)
        await server.stream.send_all(b" first")
        server.send_lock.release()
    data = b""
    while not data.endswith(b"second"):
        data += await client.receive_some(100)
    assert data == b" first second"


async def test_a_cancelled_task_does_not_write() -> None:
    """As with hypercorn's own path, a write from a cancelled task raises Cancelled and
    writes nothing; a shielded one (the end of a response) still writes."""
    server, client = await _connection_server()
    with trio.CancelScope() as scope:
        scope.cancel()
        with trio.CancelScope(shield=True):
            await server.protocol_send(RawData(data=b"shielded"))
        await server.protocol_send(RawData(data=b"dropped"))
    assert scope.cancelled_caught
    await server.stream.aclose()
    data = b""
    while chunk := await client.receive_some(100):
        data += chunk
    assert data == b"shielded"


async def test_a_finished_connection_is_freed_without_the_cycle_collector() -> None:
    """Once a connection has ended, its server, hypercorn's protocol objects and the idle
    timer no longer refer to each other: reference counting frees them at once (with the
    cycle collector off), so a churn of short connections leaves it nothing to find."""
    refs: list[weakref.ref[Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        server = connection_server(send)
        assert server is not None
        refs.extend(
            weakref.ref(o)
            for o in (
                server,
                server.protocol,
                server.protocol.protocol,
                server.protocol.protocol.connection,
            )
        )
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    gc.disable()
    try:
        answer = await answer_on_local_connection(
            app, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 204")
        assert len(refs) == 4
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()


async def test_a_request_is_told_when_its_client_leaves_and_only_once() -> None:
    """``watch_close``: the callback runs once, synchronously, when the client closes the
    connection mid-request; a callback removed with ``unwatch_close`` never runs; once
    the reading has ended, registering is refused (False)."""
    calls: list[str] = []
    left = trio.Event()
    registered: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        watch = close_watch(send)
        assert watch is not None
        assert watch.watch_close(lambda: calls.append("removed"))
        watch.unwatch_close()
        assert watch.watch_close(lambda: (calls.append("left"), left.set()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await left.wait()
        registered.append(watch.watch_close(lambda: calls.append("too late")))

    answer = await answer_on_local_connection(app, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    assert calls == ["left"] and registered == [False]


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Both ends of a TCP connection on 127.0.0.1: (the server's, the client's)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    accepted, _ = await listener.accept()
    listener.close()
    return trio.SocketStream(accepted), trio.SocketStream(client)


@pytest.mark.parametrize("how", ["client closes", "client resets", "server closes", "cancelled"])
async def test_the_reading_ends_once_whichever_way_the_connection_ends(how: str) -> None:
    """Rule 6: the connection's stream tells the server (``on_end``: the idle timer) and the
    watching request, once each, when its reading ends -- a read that returns the end of
    the stream, or one that raises (a reset, the stream closed under it, a cancelled
    read); the request's watch is refused from then on."""
    ours, theirs = await _tcp_pair()
    ends: list[str] = []
    receipt = ReceiptStream(ours, on_end=lambda: ends.append("server"))
    assert receipt.watch_close(lambda: ends.append("request"))

    async def read() -> None:
        try:
            while await receipt.receive_some(100):
                pass
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert ends == []  # a read waiting for bytes has not ended anything
            if how == "client closes":
                await theirs.aclose()
            elif how == "client resets":
                theirs.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                await theirs.aclose()
            elif how == "server closes":
                await receipt.aclose()
            else:
                nursery.cancel_scope.cancel()
    assert ends == ["server", "request"]
    assert not receipt.watch_close(lambda: ends.append("too late"))
    assert not receipt.reading
    await receipt.aclose()
    await theirs.aclose()


async def test_the_connections_socket_is_found_through_the_transport() -> None:
    """``connection_socket(send)`` is the trio socket stream of the request's connection
    (its peer is the request's client), through which a reset (``SO_LINGER`` 0, then a
    close) reaches the client; off a hooked connection there is none."""
    install_connection_hook()
    found: list[tuple[Any, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        stream = connection_socket(send)
        assert isinstance(stream, trio.SocketStream)
        found.append((stream.socket.getpeername(), scope["client"]))
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, app, config)
            port = int(binds[0].rsplit(":", 1)[1])
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with pytest.raises(trio.BrokenResourceError):  # ECONNRESET
                while await client.receive_some(4096):
                    pass
            await client.aclose()
            nursery.cancel_scope.cancel()
    [(peer, client_address)] = found
    assert tuple(peer) == tuple(client_address)

    async def send(message: dict[str, Any]) -> None:
        pass

    assert connection_socket(send) is None


async def test_pre_framed_chunks_skip_h11_and_keep_the_connection_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streamed response's chunks written through ``chunk_writer`` are framed exactly
    as h11 frames them (h11's client parses them), h11 sees only the start and the end of
    the body (no Data event), and the keep-alive connection serves the next request."""
    sent = record_h11_sends(monkeypatch)
    writers: list[object] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write = chunk_writer(send)
        writers.append(write)
        assert write is not None
        for part in (b"data: one\n\n", b"", b"data: two\n\n" * 300):
            await write(part)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    server, client = local_connection(app)
    raw = b""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            for _ in range(2):
                await client.send_all(request)
                answer = b""
                while not answer.endswith(b"0\r\n\r\n"):
                    answer += await client.receive_some(65536)
                raw += answer
            await client.aclose()
    assert sent == ["Response", "EndOfMessage"] * 2  # the server's h11: no Data event
    for status, _, body in h11_answers(raw, 2):
        assert status == 200 and body == b"data: one\n\n" + b"data: two\n\n" * 300


@pytest.mark.parametrize(
    ("request_line", "headers", "why"),
    [
        (b"GET / HTTP/1.0", [], "an HTTP/1.0 client's body is not chunked"),
        (b"GET / HTTP/1.1", [(b"content-length", b"9")], "a declared length"),
        (b"HEAD / HTTP/1.1", [], "a HEAD answer has no body"),
    ],
)
async def test_no_chunk_writer_where_the_body_is_not_chunked(
    request_line: bytes, headers: list[tuple[bytes, bytes]], why: str
) -> None:
    found: list[object] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        found.append(chunk_writer(send))  # not started yet: none either
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        found.append(chunk_writer(send))
        await send({"type": "http.response.body", "body": b"123456789", "more_body": False})

    await answer_on_local_connection(app, request_line + b"\r\nhost: x\r\n\r\n")
    assert found == [None, None], why


async def test_no_chunk_writer_off_a_hooked_connection() -> None:
    async def send(message: dict[str, Any]) -> None:
        pass

    assert chunk_writer(send) is None


async def test_a_chunk_for_a_stream_hypercorn_saw_close_writes_nothing() -> None:
    """Once hypercorn has seen the client leave (the request stream closed), a chunk is
    dropped as hypercorn would drop a body message."""
    writes: list[bytes] = []
    done = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        write = chunk_writer(send)
        assert write is not None
        server = connection_server(send)
        assert server is not None
        plain = server.protocol_send

        async def recording(event: Any) -> None:
            writes.append(getattr(event, "data", b""))
            await plain(event)

        server.protocol_send = recording  # type: ignore[method-assign]
        while (await receive())["type"] != "http.disconnect":
            pass
        await write(b"data: late\n\n")
        done.set()

    await answer_on_local_connection(app, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    with trio.fail_after(5):
        await done.wait()
    assert writes == []


# -- deadlines for request heads and for HTTP/2 ---------------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def _closed_within(port: int, data: bytes, seconds: float) -> tuple[bool, bytes]:
    """Send ``data`` and nothing more: (whether the server closed the connection within
    ``seconds``, what it sent)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    closed = False
    try:
        await stream.send_all(data)
        with trio.move_on_after(seconds):
            while chunk := await stream.receive_some(65536):
                got += chunk
            closed = True
    except trio.BrokenResourceError:
        closed = True
    finally:
        await stream.aclose()
    return closed, got


@pytest.mark.parametrize(
    "opening",
    [H2_PREFACE, H2_PREFACE + b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x82"],
    ids=["preface only", "HEADERS without END_HEADERS"],
)
async def test_an_idle_h2c_connection_is_closed_like_an_idle_http1_one(opening: bytes) -> None:
    """HTTP/2 over cleartext gets HTTP/1.1's deadline: a connection with a preface alone,
    or a HEADERS block never ended, is closed once keep_alive_timeout has passed with no
    stream in progress (here 1 s; well within 10 s on a loaded machine)."""
    with trio.fail_after(30):
        async with running_server(make_settings(), keep_alive_timeout=1.0) as (_, port, _s):
            closed, _ = await _closed_within(port, opening, 10.0)
    assert closed


async def test_an_h2c_request_is_still_answered() -> None:
    """The HTTP/2 deadline does not cut a working h2c exchange: a prior-knowledge GET
    /health is answered 200 over HTTP/2."""
    import h2.config
    import h2.connection
    import h2.events

    with trio.fail_after(30):
        async with running_server(make_settings(), keep_alive_timeout=1.0) as (_, port, _s):
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(
                1,
                [(":method", "GET"), (":path", "/health"), (":scheme", "http"),
                 (":authority", "127.0.0.1")],
                end_stream=True,
            )  # fmt: skip
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(conn.data_to_send())
            status = None
            ended = False
            while not ended:
                data = await stream.receive_some(65536)
                assert data, "the server closed the h2c connection before answering"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                    if isinstance(event, h2.events.StreamEnded):
                        ended = True
                await stream.send_all(conn.data_to_send())
            await stream.aclose()
    assert status == b"200"


async def test_a_request_head_slower_than_the_deadline_is_answered_408() -> None:
    """A request head that has not arrived whole when keep_alive_timeout passes is
    answered 408 in the OpenAI envelope with Connection: close, then the connection is
    closed (not dropped silently)."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: app"
    with trio.fail_after(30):
        async with running_server(make_settings(), keep_alive_timeout=1.0) as (_, port, _s):
            closed, got = await _closed_within(port, head, 10.0)
            silent, nothing = await _closed_within(port, b"", 10.0)
    assert closed and got.startswith(b"HTTP/1.1 408")
    headers, _, body = got.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    error = __import__("json").loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert silent and nothing == b""  # a connection that sent nothing is closed quietly


@pytest.mark.parametrize("read_timeout", [None, 5.0])
async def test_reads_go_without_a_cancel_scope_unless_a_read_timeout_is_set(
    monkeypatch: pytest.MonkeyPatch, read_timeout: float | None
) -> None:
    """Rule 8: with no read timeout (hypercorn's default) the connection's reads are not
    wrapped in hypercorn's per-read ``fail_after``; with one, hypercorn's own reader runs
    (and so its timeout applies). Either way the request is answered."""
    from hypercorn.trio.tcp_server import TCPServer

    hypercorns: list[object] = []
    real_read_data = TCPServer._read_data

    async def recording_read_data(self: TCPServer) -> None:
        hypercorns.append(self)
        await real_read_data(self)

    monkeypatch.setattr(TCPServer, "_read_data", recording_read_data)
    config = Config()
    config.accesslog = None
    config.read_timeout = read_timeout

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = [(b"content-length", b"2")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"ok"})

    server, client = local_connection(app, config)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            answer = await read_until_eof(client)
            await client.aclose()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
    assert hypercorns == ([] if read_timeout is None else [server])
