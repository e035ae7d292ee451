"""The two places where serve relies on how hypercorn and quart-trio work inside.

Both are pinned by upper bounds on the two packages (``pyproject.toml``); these tests fail
loudly when a new release changes what they rely on:

- the fix for hypercorn issue #330: quart-trio cancels a Quart route's request scope when
  hypercorn reports the disconnect that its own end-of-response handling emits, so the
  route's final ``http.response.body`` must be sent shielded (``LabHTTPConnection``
  overrides quart-trio's ``handle_request`` to do that);
- the arrival stamp: hypercorn's per-request stream notes when it parsed the request, and
  ``received_at`` reads it through the ``send`` callable it hands the app; earlier still,
  the connection's stream (wrapped by ``install_connection_hook``, which replaces the
  ``TCPServer`` class hypercorn's trio worker instantiates per connection) notes when the
  read that brought the request returned.
"""

from __future__ import annotations

import inspect
import json
import math
import socket
import struct
import time
from typing import Any

import attrs
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer
from quart_trio.asgi import TrioASGIHTTPConnection

from inference_lab.serve import create_app
from inference_lab.serve.asgi import LabHTTPConnection
from inference_lab.serve.completions import _receive_nowait, read_body
from inference_lab.serve.transport.connection import (
    LabTCPServer,
    ReceiptStream,
    install_connection_hook,
    received_at,
)
from inference_lab.socket_stamps import SO_TIMESTAMPNS, enable_receive_timestamps
from tests.conftest import GPT, ServeFactory, make_settings
from tests.serve_util import post_closing
from tests.transport_util import (
    answer_on_local_connection,
    h11_answers,
    record_h11_sends,
    writes_of,
)


def test_quart_trio_still_has_the_hook_the_fix_overrides() -> None:
    """quart-trio's connection runs each request through
    ``handle_request(nursery, request, send)``, the method the fix overrides."""
    params = list(inspect.signature(TrioASGIHTTPConnection.handle_request).parameters)
    assert params == ["self", "nursery", "request", "send"]
    assert LabHTTPConnection.handle_request is not TrioASGIHTTPConnection.handle_request


async def test_a_disconnect_during_a_quart_routes_final_send_does_not_cut_it() -> None:
    """hypercorn #330 reproduced: the client 'disconnects' (as hypercorn reports after the
    response) while the final body is being sent; the send still completes."""
    app = create_app(make_settings())
    completed: list[str] = []
    final_started = trio.Event()

    async with app.test_app():
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": "/health",
            "raw_path": b"/health",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"localhost")],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080),
            "extensions": {},
            "state": {},
        }
        sent_request = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_request
            if not sent_request:
                sent_request = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await final_started.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                final_started.set()
                await trio.sleep(0.01)  # the disconnect lands here, as in #330
                completed.append("final")

        with trio.fail_after(5):
            await app(scope, receive, send)
    assert completed == ["final"]


async def test_hypercorn_still_tells_the_app_when_it_received_the_request() -> None:
    """Under hypercorn's trio worker ``received_at`` finds a receipt time before the app
    was called (not the time of the call), and hypercorn still notes its parse time."""
    [seen] = await _serve_recording([b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"], pause=0.0)
    assert type(seen.start) is float and math.isclose(seen.start, time.time(), abs_tol=5.0)
    assert seen.arrival < seen.now  # received (and parsed) before the app was called


def test_hypercorn_still_builds_each_connections_server_from_the_hooked_name() -> None:
    """The receipt hook relies on hypercorn's trio worker building
    ``TCPServer(app, config, context, state, stream)`` per connection from the name in
    ``hypercorn.trio.run`` (``create_app`` installs it there), and the idle timer on how
    ``TCPServer`` uses its ``idle_task``."""
    params = list(inspect.signature(TCPServer.__init__).parameters)
    assert params == ["self", "app", "config", "context", "state", "stream"]
    # the idle timer it replaces is used through these two calls only (connection.py Rule 3)
    source = inspect.getsource(TCPServer)
    assert source.count("self.idle_task.") == 3
    assert source.count("self.idle_task.restart(self._task_group, self._idle_timeout)") == 2
    assert source.count("self.idle_task.stop()") == 1
    # the close watch sees every read hypercorn makes (connection.py Rule 6)
    assert source.count("self.stream.receive_some(") == 1
    assert "TCPServer," in inspect.getsource(hypercorn_run.worker_serve)
    create_app(make_settings())
    assert hypercorn_run.TCPServer is LabTCPServer
    assert install_connection_hook() is True  # idempotent


@attrs.frozen
class Seen:
    """What a recording app saw of one request under hypercorn."""

    arrival: float  # received_at(send)
    now: float  # when the app was called
    start: Any  # hypercorn's start_time (wall clock)
    parsed: float  # start_time as trio time
    read: float  # the connection stream's latest read when the app was called
    stream: Any  # the connection's stream


async def _serve_recording(requests: list[bytes], pause: float) -> list[Seen]:
    """Serve a recording app under hypercorn's trio worker (with the receipt hook) and send
    ``requests`` on one connection, ``pause`` seconds apart, each after the previous
    answer."""
    install_connection_hook()
    seen: list[Seen] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        now = trio.current_time()
        request_stream = send.__self__
        start = request_stream.start_time
        server = request_stream.send.__self__.send.__self__
        seen.append(
            Seen(
                arrival=received_at(send),
                now=now,
                start=start,
                parsed=now - (time.time() - start),
                read=server.stream.received,
                stream=server.stream,
            )
        )
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, app, config)
            port = int(binds[0].rsplit(":", 1)[1])
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            for request in requests:
                await trio.sleep(pause)
                await stream.send_all(request)
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(4096)
            await stream.aclose()
            nursery.cancel_scope.cancel()
    return seen


async def test_hypercorn_still_hands_the_app_a_memory_channels_receive() -> None:
    """``read_body`` takes a body piece hypercorn already holds without a scheduling
    point; that relies on ``receive`` being a trio memory channel's bound ``receive``,
    with the body there when the app starts."""
    seen: list[tuple[Any, bytes]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        if _receive_nowait(receive) is not None:
            body = _receive_nowait(receive)().get("body", b"")
        seen.append((receive, body))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    answer = await answer_on_local_connection(app, request)
    [(receive, body)] = seen
    assert isinstance(receive.__self__, trio.MemoryReceiveChannel)
    assert body == b"hi" and answer.startswith(b"HTTP/1.1 204")


async def test_a_body_already_held_is_read_without_a_scheduling_point() -> None:
    """From a memory channel, pieces already there are taken at once (here inside a
    cancelled scope, where any scheduling point would raise Cancelled); a piece still to
    come is waited for as before; any other ``receive`` is awaited."""
    send, receive = trio.open_memory_channel[dict[str, Any]](10)
    scope = {"headers": []}
    await send.send({"type": "http.request", "body": b"ab", "more_body": True})
    await send.send({"type": "http.request", "body": b"c", "more_body": False})
    with trio.CancelScope() as cancelled:
        cancelled.cancel()
        assert await read_body(receive.receive, scope) == b"abc"
    await send.send({"type": "http.request", "body": b"x", "more_body": True})
    with trio.CancelScope() as cancelled:
        cancelled.cancel()
        with pytest.raises(trio.Cancelled):
            await read_body(receive.receive, scope)  # "x", then a wait for the rest
    await send.send({"type": "http.request", "body": b"z", "more_body": False})

    async def plain() -> dict[str, Any]:
        return await receive.receive()

    with trio.CancelScope() as cancelled:
        cancelled.cancel()
        with pytest.raises(trio.Cancelled):
            await read_body(plain, scope)
    assert await read_body(plain, scope) == b"z"


async def test_the_arrival_is_the_read_that_brought_the_request_in() -> None:
    """With the receipt hook a request's arrival is when the connection's read returned
    (not before it), which precedes hypercorn's parse; a later request on the same
    connection is stamped by its own read, not the first one's."""
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    seen = await _serve_recording([request, request], pause=0.2)
    [first, second] = seen
    assert isinstance(first.stream, ReceiptStream) and second.stream is first.stream
    assert first.arrival == first.read and second.arrival == second.read
    # before the parse; the margin is the conversion between the wall clock and trio's,
    # exact only to a preemption between two clock reads on a busy machine
    assert first.arrival <= first.parsed + 0.05
    assert second.arrival <= second.parsed + 0.05
    assert second.arrival - first.arrival >= 0.2 - 0.05  # the second request's own read


async def test_bytes_waiting_when_the_connection_is_taken_up_are_stamped_then() -> None:
    """A connection's first read is stamped when the server took the connection up if its
    bytes were already waiting then (``note_waiting``); a read of bytes that came later is
    stamped when it returns; bytes read after the first are never stamped early."""
    left, right = trio.socket.socketpair()
    waiting, later = trio.SocketStream(left), trio.SocketStream(right)
    await later.send_all(b"GET / HTTP/1.1\r\n\r\n")
    receipt = ReceiptStream(waiting)
    receipt.note_waiting()
    taken_up = trio.current_time()
    await trio.sleep(0.05)
    assert await receipt.receive_some(100)
    assert receipt.received <= taken_up  # noted before the server's own set-up
    await trio.sleep(0.05)
    await later.send_all(b"more")
    assert await receipt.receive_some(100) == b"more"
    assert receipt.received >= taken_up + 0.1  # when this read returned

    other = ReceiptStream(later)
    other.note_waiting()  # nothing waiting: nothing noted
    noted = trio.current_time()
    await trio.sleep(0.05)
    await waiting.send_all(b"x")
    assert await other.receive_some(100) == b"x"
    assert other.received >= noted + 0.05
    assert other.socket is later.socket  # everything else is the wrapped stream's
    await waiting.aclose()
    await later.aclose()


#: Seconds between a client's bytes and the server's accepting or reading them, and the
#: margin of a stamp's conversion from the wall clock (a preemption between two clock
#: reads on a busy machine): a stamp within the margin of the send is not the read's.
LATER = 0.2
MARGIN = 0.1


async def _send_then_accept(listener: Any) -> tuple[Any, Any, float]:
    """A client connects to ``listener`` and sends a request head; :data:`LATER` seconds
    later the server accepts. (accepted socket, client socket, when the client sent)."""
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    sent = trio.current_time()
    await client.send(b"GET / HTTP/1.1\r\n\r\n")
    await trio.sleep(LATER)
    accepted, _ = await listener.accept()
    return accepted, client, sent


async def _until_the_kernel_stamps_arrivals(listener: Any) -> None:
    """Return once a connection of ``listener`` (which asked for receive timestamps) gets
    its bytes stamped when they arrived: the kernel turns its packet stamping on for the
    whole system a moment after the first socket asks, and a packet that came before
    is stamped when it is read. The caller bounds the wait."""
    while True:
        accepted, client, sent = await _send_then_accept(listener)
        receipt = ReceiptStream(trio.SocketStream(accepted))
        await receipt.receive_some(100)
        await receipt.aclose()
        client.close()
        if receipt.received <= sent + MARGIN:
            return


@pytest.mark.skipif(SO_TIMESTAMPNS is None, reason="no kernel receive timestamps here")
async def test_a_read_is_stamped_when_the_kernel_received_its_bytes() -> None:
    """On a listener that has the kernel stamp what it receives (as ``inference-lab
    serve``'s does), a connection's read is stamped when its bytes arrived, not when the
    server got round to the connection or the read: here :data:`LATER` before both. A peer that
    breaks the connection is BrokenResourceError, a read after close ClosedResourceError,
    as with trio's own stream."""
    listener = trio.socket.socket()
    assert enable_receive_timestamps(listener)
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    with trio.fail_after(10):
        await _until_the_kernel_stamps_arrivals(listener)
    accepted, client, sent = await _send_then_accept(listener)
    receipt = ReceiptStream(trio.SocketStream(accepted))
    receipt.note_waiting()
    assert await receipt.receive_some(100) == b"GET / HTTP/1.1\r\n\r\n"
    assert sent - 0.005 <= receipt.received <= sent + MARGIN  # not the accept or the read
    again = trio.current_time()
    await client.send(b"more")
    await trio.sleep(LATER)
    assert await receipt.receive_some(100) == b"more"
    assert again - 0.005 <= receipt.received <= again + MARGIN
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset
    with pytest.raises(trio.BrokenResourceError):
        while await receipt.receive_some(100):
            pass
    await receipt.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receipt.receive_some(100)
    listener.close()


async def test_a_whole_reply_and_a_streams_end_leave_in_one_write_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under hypercorn with the hook, a whole reply (start, body, end) is one socket write,
    not three, and a stream's last frames share one write with the chunked terminator."""
    bad = post_closing({"model": "no-such-model", "prompt": "x"})
    stream = post_closing({"model": GPT, "prompt": "x", "max_tokens": 3, "stream": True})
    [reply_writes, stream_writes] = await writes_of(
        [bad, stream], monkeypatch, interval=0.0, slowdown=100.0
    )
    assert len(reply_writes) == 1
    assert reply_writes[0].startswith(b"HTTP/1.1 404") and b'"model_not_found"' in reply_writes[0]
    last = stream_writes[-1]
    assert last.endswith(b"0\r\n\r\n") and b"data: [DONE]" in last
    assert stream_writes[0].startswith(b"HTTP/1.1 200")  # the start is not held back
    # ... for the first token (writes are not spaced; a 150 ms prefill here)
    assert b"data:" not in stream_writes[0]


async def test_a_streams_frames_reach_the_socket_without_passing_through_h11(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A served stream's frames go to the connection pre-framed (streaming Rule 6): h11
    encodes the response start and the end of the body only, and what the client gets
    is a well-framed chunked body carrying every token, the usage and ``[DONE]``."""
    events = record_h11_sends(monkeypatch)
    stream = post_closing(
        {
            "model": GPT,
            "prompt": "x",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    [writes] = await writes_of([stream], monkeypatch, interval=0.0, slowdown=100.0)
    assert events == ["Response", "EndOfMessage"]
    assert len(writes) >= 3  # the start, mid-stream frames, the last ones
    [(status, _, body)] = h11_answers(b"".join(writes), 1)
    assert status == 200
    frames = [f for f in body.split(b"\n\n") if f]
    texts = [f for f in frames if b'"text":"' in f and b"finish_reason" not in f]
    assert len(texts) == 5 and b'"finish_reason":"length"' in frames[-3]
    assert b'"usage"' in frames[-2] and frames[-1] == b"data: [DONE]"


async def test_a_streams_start_shares_a_write_with_its_first_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chat stream's headers leave with its role frame; while delivery spaces writes (a
    saturated loop), a completions stream's headers wait for its first token and leave
    with it: one socket write less per request."""
    chat = post_closing(
        {
            "model": GPT,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "stream": True,
        },
        b"/v1/chat/completions",
    )
    plain = post_closing({"model": GPT, "prompt": "x", "max_tokens": 3, "stream": True})
    [chat_writes, _] = await writes_of([chat, plain], monkeypatch, slowdown=100.0)
    assert chat_writes[0].startswith(b"HTTP/1.1 200") and b'"role":"assistant"' in chat_writes[0]
    assert b'"content"' not in chat_writes[0]  # the first token comes 150 ms later
    [plain_writes] = await writes_of([plain], monkeypatch, interval=0.002, slowdown=100.0)
    first = plain_writes[0]
    assert first.startswith(b"HTTP/1.1 200") and b'"text"' in first
    assert plain_writes[-1].endswith(b"0\r\n\r\n")


async def test_options_without_an_allowed_origin_is_405_not_an_empty_200(
    serve: ServeFactory,
) -> None:
    """OPTIONS is no route's method (CORS preflights from allowed origins are answered by
    the gate): it is a 405 envelope, not Quart's automatic 200."""
    async with serve() as s:
        for path in ("/health", "/v1/models", "/v1/chat/completions"):
            response = await s.client.options(path)
            assert response.status_code == 405, path
            body = json.loads(await response.get_data())
            assert body["error"]["code"] == "method_not_allowed"


def test_a_bad_environment_under_plain_hypercorn_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``create_app()`` configured from a bad environment stops the launch with one line
    (no traceback)."""
    monkeypatch.setenv("INFERENCE_LAB_MAX_WAITING", "-3")
    with pytest.raises(SystemExit) as info:
        create_app()
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "INFERENCE_LAB_MAX_WAITING" in err[0]
