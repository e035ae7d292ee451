"""Mid-stream tokens and a stream's end written by the engine's hand-over itself
(streaming Rules 7 and 8, connection Rule 10).

A stream's writer parked for frames is not woken for mid-stream tokens when the engine's
synchronous hand-over (``StreamSink.on_tokens``) can write them to the connection at once,
nor for its end (the last token, the end frames and the chunked terminator, in one write:
``StreamSink.on_finished``), after which it only ends the response in the HTTP stack, whose
terminator is not written twice; everything else -- the start, a gathered first write, a
spaced-out delivery's mid-stream tokens, what the socket did not take -- stays the
writer's.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from inference_lab.api.encoding import StreamEncoder
from inference_lab.api.requests import parse_completion_request
from inference_lab.core.engine import Finished
from inference_lab.runtime import model_runtime as runtime_module
from inference_lab.serve import create_app
from inference_lab.serve.asgi import get_state
from inference_lab.serve.streaming import Delivery, StreamSink, write_stream
from inference_lab.serve.transport.connection import ReceiptStream, local_connection
from tests.conftest import GPT, make_settings
from tests.serve_util import post_closing, serving
from tests.transport_util import h11_answers, writes_of

REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
LAST = 5


@attrs.define
class Served:
    """One stream's writer on a hooked connection over a socket pair."""

    sink: StreamSink
    delivery: Delivery
    client: trio.SocketStream
    raw: bytearray = attrs.Factory(bytearray)

    def on_socket(self) -> bytes:
        """What the server has written that the client has not read yet, read without a
        scheduling point (so nothing else ran since the caller's last step)."""
        fd = self.client.socket.fileno()  # non-blocking (trio's)
        got = b""
        while True:
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            got += chunk
        self.raw += got
        return got

    async def read_to_end(self) -> None:
        while not self.raw.endswith(b"0\r\n\r\n"):
            self.raw += await self.client.receive_some(1 << 20)


def _finished(tokens: int) -> Finished:
    return Finished(
        request_id=0,
        prompt_tokens=1,
        output_tokens=tokens,
        finish_reason="length",
        arrival_time=0.0,
        first_scheduled_time=0.0,
        first_token_time=0.0,
        finish_time=0.0,
        preemptions=0,
    )


@asynccontextmanager
async def served_stream(
    *, gather_start: bool = False, interval: float | None = None, sndbuf: int | None = None
) -> AsyncIterator[Served]:
    """A completions stream of :data:`LAST` tokens served by ``write_stream`` on a hooked
    connection, its writer parked for its first token. ``gather_start``: the response's
    start is handed to the writer to leave with the first frames (as a saturated loop
    does); else it has left already. ``sndbuf``: the server socket's send buffer."""
    parsed = parse_completion_request(
        {"model": GPT, "prompt": "x", "max_tokens": LAST, "stream": True}, 16
    )
    sink = StreamSink(StreamEncoder(parsed, request_id="cmpl-test", created=0))
    sink.last = LAST
    delivery = Delivery()
    if interval is not None:
        delivery.force_interval(interval)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        start = {"type": "http.response.start", "status": 200, "headers": []}
        if gather_start:
            await write_stream(send, sink, delivery, start)
        else:
            await send(start)
            await write_stream(send, sink, delivery)

    server, client = local_connection(app)
    if sndbuf is not None:
        server.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    served = Served(sink, delivery, client)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(REQUEST)
            while not sink.waiting:  # the writer is parked for frames
                await trio.lowlevel.checkpoint()
            if not gather_start:
                while b"\r\n\r\n" not in served.raw:
                    served.raw += await client.receive_some(65536)
            yield served
            await client.aclose()


def _texts(raw: bytes) -> list[str]:
    [(status, _, body)] = h11_answers(raw, 1)
    assert status == 200
    texts = []
    for frame in body.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            texts.append(json.loads(frame[6:])["choices"][0]["text"])
    return texts


async def test_a_parked_writers_mid_stream_token_leaves_within_the_hand_over() -> None:
    """The token is on the socket when ``on_tokens`` returns, before any other task ran,
    and the writer was not woken for it."""
    async with served_stream() as s:
        for i in range(1, LAST):
            s.sink.on_tokens(1)
            frame = s.on_socket()
            assert frame.count(b"data: ") == 1, i
            assert s.sink.waiting  # still parked: nobody woke it
            assert s.sink.written == i
        s.sink.on_tokens(1)
        s.sink.on_finished(_finished(LAST))
        await s.read_to_end()
    texts = _texts(bytes(s.raw))
    assert len(texts) == LAST + 1 and texts[-1] == ""  # the tokens, then the finish frame


async def test_the_last_token_leaves_with_the_end_of_the_stream_within_the_hand_over() -> None:
    """The last token is not written on its own: it leaves with the finish frame,
    ``[DONE]`` and the chunked terminator (streaming Rule 1), its word without the
    trailing space (the streamed text equals the non-streamed one), in one write made by
    ``on_finished`` before any other task ran (Rule 8). The writer then ends the response
    without a second terminator."""
    async with served_stream() as s:
        s.sink.on_tokens(LAST - 1)
        assert s.on_socket().count(b"data: ") == LAST - 1
        s.sink.on_tokens(1)
        assert s.on_socket() == b""
        assert not s.sink.waiting  # the writer was woken, and has not run yet
        s.sink.on_finished(_finished(LAST))
        tail = s.on_socket()
        assert s.sink.ended
        for _ in range(20):  # the writer runs: it ends the response, writing nothing
            await trio.lowlevel.checkpoint()
        assert s.on_socket() == b""
    assert tail.count(b'"text":"') == 2 and tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert tail.count(b"0\r\n\r\n") == 1
    texts = _texts(bytes(s.raw))
    assert texts[LAST - 1] and not texts[LAST - 1].endswith(" ")
    assert all(t.endswith(" ") for t in texts[: LAST - 1])


async def test_the_end_leaves_within_the_hand_over_while_delivery_spaces_writes() -> None:
    """A spaced-out delivery holds mid-stream tokens back, never a stream's end (Rule 2):
    a writer held back has its stream's end written by the hand-over (Rule 8)."""
    async with served_stream(interval=60.0) as s:
        s.sink.on_tokens(1)
        assert s.on_socket() == b""
        while not s.sink.hold:  # the writer wrote the first token and holds
            await trio.lowlevel.checkpoint()
        s.sink.on_tokens(LAST - 1)
        assert s.on_socket().count(b"data: ") <= 1  # (the first token's write, at most)
        s.sink.on_finished(_finished(LAST))
        assert s.on_socket().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        await s.read_to_end()
    assert len(_texts(bytes(s.raw))) == LAST + 1


async def test_no_hand_over_write_while_delivery_spaces_writes() -> None:
    """A saturated loop's delivery (a non-zero interval) keeps its spacing: the writer
    is woken and writes, then holds."""
    async with served_stream(interval=0.001) as s:
        s.sink.on_tokens(1)
        assert s.on_socket() == b""
        assert not s.sink.waiting
        while s.sink.written < 1:
            await trio.lowlevel.checkpoint()
        s.sink.on_tokens(LAST - 1)
        s.sink.on_finished(_finished(LAST))
        await s.read_to_end()
    assert len(_texts(bytes(s.raw))) == LAST + 1


async def test_delivery_can_turn_the_hand_over_writes_off() -> None:
    async with served_stream() as s:
        s.delivery.direct = False
        s.sink.on_tokens(1)
        assert s.on_socket() == b"" and not s.sink.waiting
        s.sink.on_tokens(LAST - 1)
        s.sink.on_finished(_finished(LAST))
        await s.read_to_end()
    assert len(_texts(bytes(s.raw))) == LAST + 1


async def test_no_hand_over_write_into_a_gathered_first_write() -> None:
    """While the start waits to leave with the first frames (one socket write), a token
    is not written ahead of it: the writer is woken and the start and the token leave
    together."""
    async with served_stream(gather_start=True) as s:
        assert s.on_socket() == b""  # the start is held for the first frames
        s.sink.on_tokens(1)
        assert s.on_socket() == b""
        assert not s.sink.waiting
        while not s.raw:
            s.raw += await s.client.receive_some(65536)
        first = bytes(s.raw)
        assert first.startswith(b"HTTP/1.1 200") and first.count(b"data: ") == 1
        s.sink.on_tokens(LAST - 1)
        s.sink.on_finished(_finished(LAST))
        await s.read_to_end()
    assert len(_texts(bytes(s.raw))) == LAST + 1


async def test_what_the_socket_did_not_take_is_finished_by_the_writer_in_order() -> None:
    """A hand-over write larger than the socket's free buffer leaves a framed tail; the
    writer is woken and sends it before anything newer, so the chunked body stays
    well-framed and every token arrives once, in order."""
    many = 4000
    async with served_stream(sndbuf=4096) as s:
        s.sink.last = many + 2
        s.sink.on_tokens(many)  # ~600 KB of frames: far more than the buffer takes
        assert s.sink.unsent and not s.sink.waiting
        s.sink.on_tokens(1)  # pending behind the tail
        while s.sink.unsent or s.sink.pending():
            s.on_socket()
            await trio.lowlevel.checkpoint()
        s.sink.on_tokens(1)
        s.sink.on_finished(_finished(many + 2))
        await s.read_to_end()
    texts = _texts(bytes(s.raw))
    assert len(texts) == many + 3
    sink = StreamSink(s.sink.encoder)
    sink.emitted = many + 2
    sink.finished = True
    expected = [json.loads(f[6:])["choices"][0]["text"] for f in sink.take().split(b"\n\n") if f]
    assert texts[:-1] == expected


async def test_no_hand_over_write_once_the_client_left() -> None:
    async with served_stream() as s:
        s.sink.on_gone()
        s.sink.on_tokens(1)
        assert s.on_socket() == b""


async def test_served_streams_write_mid_stream_tokens_from_the_engine_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``inference-lab serve``'s set-up, a stream's mid-stream tokens are written
    by the engine task, one write each, and so is its last write (the last token and the
    end, one terminator); its start by the request's own task."""
    writers: list[tuple[str, bytes]] = []
    plain = ReceiptStream.send_nowait

    def recording(self: ReceiptStream, data: bytes) -> int:
        sent = plain(self, data)
        if sent:
            task = trio.lowlevel.current_task().name.rsplit(".", 1)[-1]
            writers.append((task, bytes(data[:sent])))
        return sent

    monkeypatch.setattr(ReceiptStream, "send_nowait", recording)
    stream = post_closing({"model": GPT, "prompt": "x", "max_tokens": LAST, "stream": True})
    [writes] = await writes_of([stream], monkeypatch, interval=0.0, slowdown=100.0)
    assert len(writes) == LAST + 1  # the start, LAST - 1 tokens, the last token with the end
    ours = [(task, data) for task, data in writers if data in writes]
    assert [task for task, _ in ours[1:]] == ["_engine_task"] * LAST
    assert ours[0][0] != "_engine_task"
    assert ours[-1][1].endswith(b"0\r\n\r\n")
    assert b"".join(writes).count(b"0\r\n\r\n") == 1


async def _start_and_take(
    monkeypatch: pytest.MonkeyPatch, *, others: int
) -> tuple[list[str], list[str]]:
    """Under ``inference-lab serve``'s set-up (engine steps priced at 100x, delivery not
    spacing writes), with ``others`` long streams already running, send
    one more stream: the order in which the engine task took it (``taken``) and its
    response start was written (``start``), and which task wrote its first token."""
    events: list[str] = []
    first_token: list[str] = []
    handle_message = runtime_module.ModelRuntime._handle
    plain = ReceiptStream.send_nowait

    def taking(self: Any, message: Any) -> None:
        if isinstance(message, runtime_module._Arrival):
            events.append("taken")
        handle_message(self, message)

    def recording(self: ReceiptStream, data: bytes) -> int:
        sent = plain(self, data)
        if sent and bytes(data).startswith(b"HTTP/1.1 200"):
            events.append("start")
        elif sent and b'"text"' in bytes(data) and "start" in events and not first_token:
            first_token.append(trio.lowlevel.current_task().name.rsplit(".", 1)[-1])
        return sent

    app = create_app(make_settings())
    state = get_state(app)
    body = {"model": GPT, "prompt": "x", "max_tokens": 40, "stream": True}
    with trio.fail_after(20):
        async with serving(app) as port:
            state.delivery.force_interval(0.0)
            [runtime] = state.runtimes.values()
            runtime.set_step_time_factor(100.0)
            clients = []
            for _ in range(others + 1):
                clients.append(await trio.open_tcp_stream("127.0.0.1", port))
            for client in clients[:others]:
                await client.send_all(post_closing(body))
                received = b""
                while b'"text"' not in received:  # its first token: it is in the engine
                    received += await client.receive_some(65536)
            assert runtime.snapshot().running == others
            monkeypatch.setattr(runtime_module.ModelRuntime, "_handle", taking)
            monkeypatch.setattr(ReceiptStream, "send_nowait", recording)
            await clients[-1].send_all(post_closing(body))
            while not first_token:
                await clients[-1].receive_some(65536)
            monkeypatch.undo()
            for client in clients:
                await client.aclose()
    return events, first_token


async def test_the_only_request_of_an_idle_engine_starts_before_the_engine_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream into an idle engine has its response start written first (when the
    engine takes it moves none of its steps), and its first token is written by the
    engine task's hand-over (streaming Rules 5 and 7)."""
    events, first_token = await _start_and_take(monkeypatch, others=0)
    assert events == ["start", "taken"]
    assert first_token == ["_engine_task"]


async def test_with_other_requests_in_the_engine_a_streams_start_waits_for_the_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With another request in the engine, the engine takes a new stream before its
    response start is written (the engine sees the arrival as early as it can)."""
    events, first_token = await _start_and_take(monkeypatch, others=1)
    assert events == ["taken", "start"]
    assert first_token == ["_engine_task"]


def test_delivery_spaces_writes_out_while_the_loop_is_busy_and_back_when_it_is_not() -> None:
    """The control decision: above HIGH the interval starts at MIN_INTERVAL and grows by
    GROW up to MAX_INTERVAL; below LOW it shrinks by GROW, to zero under MIN_INTERVAL;
    in between it stays for PROBE_EVERY seconds after its last change."""
    d = Delivery()
    high, low, band, now = d.HIGH + 0.01, d.LOW - 0.01, (d.HIGH + d.LOW) / 2, 100.0
    d._changed = now
    assert d.decide(high, now) == d.MIN_INTERVAL
    d.interval = d.MIN_INTERVAL
    assert d.decide(high, now) == pytest.approx(d.MIN_INTERVAL * d.GROW)
    d.interval = d.MAX_INTERVAL
    assert d.decide(high, now) == d.MAX_INTERVAL
    d.interval = 0.004
    assert d.decide(band, now) == 0.004
    assert d.decide(band, now + d.PROBE_EVERY * 0.9) == 0.004
    assert d.decide(low, now) == pytest.approx(0.004 / d.GROW)
    d.interval = d.MIN_INTERVAL * 1.2
    assert d.decide(low, now) == 0.0
    d.interval = 0.0
    assert d.decide(low, now) == 0.0 and d.decide(band, now + 10) == 0.0


def test_a_spaced_out_loop_in_the_band_tries_one_step_less_now_and_then() -> None:
    """Spacing writes out costs wake-ups of its own and stops the hand-over's writes, so
    a loop spaced out by a transient can sit between LOW and HIGH where it would be below
    HIGH unspaced: every PROBE_EVERY seconds there the interval tries one step smaller,
    down to zero, and a loop that then passes HIGH takes the step back."""
    d = Delivery()
    busy = [d.HIGH + 0.01]

    class Monitor:
        def busy(self) -> float:
            return busy[0]

    d._monitor = Monitor()  # type: ignore[assignment]
    d.busy = busy[0]
    t = 10.0
    for _ in range(3):  # a transient: 1 ms, 1.5 ms, 2.25 ms
        d._control(t)
        t += d.PERIOD
    assert d.interval == pytest.approx(d.MIN_INTERVAL * d.GROW**2)
    busy[0] = d.busy = (d.HIGH + d.LOW) / 2
    seen = []
    while d.interval > 0 and t < 20.0:
        d._control(t)
        seen.append((round(t - 10.0, 2), d.interval))
        t += d.PERIOD
    steps = [
        (at, interval)
        for (at, interval), (_, before) in zip(seen[1:], seen, strict=False)
        if interval != before
    ]
    expected = [d.MIN_INTERVAL * d.GROW, d.MIN_INTERVAL, 0.0]
    assert [interval for _, interval in steps] == pytest.approx(expected)
    assert steps[0][0] == pytest.approx(0.1 + d.PROBE_EVERY, abs=d.PERIOD)  # after the last
    for (before, _), (after, _) in zip(steps, steps[1:], strict=False):
        assert after - before == pytest.approx(d.PROBE_EVERY, abs=d.PERIOD)
    busy[0] = 1.0  # unspaced, the loop passes HIGH again: spaced out after a few periods
    for _ in range(4):
        d._control(t)
        t += d.PERIOD
    assert d.interval > 0


def test_one_busy_period_does_not_space_writes_out_a_busy_loop_does() -> None:
    """The decisions see the busy share smoothed over a few periods: one period at 100 %
    amid 60 % (another process, a burst) leaves delivery unspaced; 100 % held for a few
    periods spaces it out."""
    d = Delivery()
    busy = [0.6]

    class Monitor:
        def busy(self) -> float:
            return busy[0]

    d._monitor = Monitor()  # type: ignore[assignment]
    t = 10.0
    for value in [0.6] * 10 + [1.0] + [0.6] * 10:
        busy[0] = value
        d._control(t)
        t += d.PERIOD
        assert d.interval == 0.0, t
    busy[0] = 1.0
    periods = 0
    while d.interval == 0.0:
        d._control(t)
        t += d.PERIOD
        periods += 1
    assert 2 <= periods <= 5


async def test_a_connection_ended_by_the_hand_over_serves_its_next_request() -> None:
    """Connection Rule 10: three streams back to back on one keep-alive connection, each
    ended by the engine's hand-over (Rule 8): each answer is whole and alone on the wire
    (h11 parses exactly three, one terminator each), and a plain request follows."""
    app = create_app(make_settings())
    state = get_state(app)
    body = {"model": GPT, "prompt": "x", "max_tokens": LAST, "stream": True}
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    ended: list[bool] = []
    plain = StreamSink.on_finished

    def recording(self: StreamSink, finished: Finished) -> None:
        plain(self, finished)
        ended.append(self.ended)

    raw = b""
    with trio.fail_after(20), pytest.MonkeyPatch.context() as patch:
        patch.setattr(StreamSink, "on_finished", recording)
        async with serving(app) as port:
            state.delivery.force_interval(0.0)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            for k in range(1, 4):
                await stream.send_all(request)
                while raw.count(b"0\r\n\r\n") < k:
                    raw += await stream.receive_some(65536)
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            while b'"object":"list"' not in raw:
                raw += await stream.receive_some(65536)
            await stream.aclose()
    answers = h11_answers(raw, 4)
    assert [status for status, _, _ in answers] == [200] * 4
    assert all(body.endswith(b"data: [DONE]\n\n") for _, _, body in answers[:3])
    assert ended == [True, True, True]
