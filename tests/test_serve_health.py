"""``GET /health`` answered where it is read (``serve/health.py``, ``transport/quick.py``):
in the scheduling batch whose read brought it, with no batch between the read and the
answer however much other work is runnable; the same answer the route gives (request
id, CORS, a stopped engine, a shutdown); and every request the quick path leaves
(pipelined, ``Connection: close``, HTTP/1.0, a query, a body) answered the usual way.
Real sockets on 127.0.0.1 under ``trio.fail_after``; nothing here reads a clock's value."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel

from inference_lab.serve.settings import ServeSettings
from inference_lab.serve.transport.connection import ReceiptStream
from tests.conftest import GPT, LLAMA, make_settings
from tests.serve_util import http_request, read_until_eof, running_server
from tests.transport_util import h11_answers


class Batches:
    """Counts the event loop's scheduling batches: one task that checkpoints at once
    every time it runs, beside ``busy`` tasks that are always runnable (the queue of
    work a saturated server holds)."""

    def __init__(self) -> None:
        self.count = 0
        self.stopped = False

    async def spin(self) -> None:
        while not self.stopped:
            self.count += 1
            await trio.lowlevel.checkpoint()

    async def busy(self) -> None:
        while not self.stopped:
            await trio.lowlevel.checkpoint()


@asynccontextmanager
async def batches_of_work(busy: int = 32) -> AsyncIterator[Batches]:
    counter = Batches()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(counter.spin)
        for _ in range(busy):
            nursery.start_soon(counter.busy)
        try:
            yield counter
        finally:
            counter.stopped = True


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One whole answer with a ``content-length`` body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        body += await stream.receive_some(65536)
    return data


async def batches_from_read_to_answer(
    monkeypatch: pytest.MonkeyPatch, port: int, counter: Batches, target: str, close: bool
) -> tuple[int, bytes]:
    """Send ``GET target`` on a new connection (``Connection: close`` or keep-alive); the
    batches that passed between the server's read of it and its first write of the
    answer, and the answer."""
    read_at: list[int] = []
    wrote_at: list[int] = []
    plain_receive, plain_send = ReceiptStream.receive_some, ReceiptStream.send_nowait

    async def receive(self: ReceiptStream, max_bytes: int | None = None) -> Any:
        data = await plain_receive(self, max_bytes)
        if data:
            read_at.append(counter.count)
        return data

    def send_nowait(self: ReceiptStream, data: bytes) -> int:
        if read_at and not wrote_at:
            wrote_at.append(counter.count)
        return plain_send(self, data)

    monkeypatch.setattr(ReceiptStream, "receive_some", receive)
    monkeypatch.setattr(ReceiptStream, "send_nowait", send_nowait)
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(http_request("GET", target, close=close))
        answer = await read_answer(stream)
        await stream.aclose()
    finally:
        monkeypatch.setattr(ReceiptStream, "receive_some", plain_receive)
        monkeypatch.setattr(ReceiptStream, "send_nowait", plain_send)
    assert len(read_at) == 1 and len(wrote_at) == 1
    return wrote_at[0] - read_at[0], answer


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
async def test_health_is_answered_in_the_batch_that_read_it(
    close: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """health Rule 2 / quick Rule 2: with 32 tasks always runnable, ``/health`` is written
    in the very batch whose read brought it (0 batches between), where ``/version``,
    answered by its Quart route in a task of its own, waits at least one batch behind the
    queue of work: under load each batch is the time the whole queue takes. The same
    with ``Connection: close``, as a kubelet's probe sends."""
    with trio.fail_after(30):
        async with running_server(make_settings()) as (_, port, _state):
            async with batches_of_work() as counter:
                quick, answer = await batches_from_read_to_answer(
                    monkeypatch, port, counter, "/health", close
                )
                routed, version = await batches_from_read_to_answer(
                    monkeypatch, port, counter, "/version", close
                )
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')
    assert version.startswith(b"HTTP/1.1 200 ")
    assert quick == 0
    assert routed >= 1


def _comparable(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Headers by name, without the ones that differ per answer or per server."""
    out = {bytes(k).lower(): bytes(v) for k, v in headers}
    for name in (b"date", b"server"):
        out.pop(name, None)
    if out.get(b"x-request-id", b"").startswith(b"req-"):
        out[b"x-request-id"] = b"req-*"
    return out


async def _on_the_wire(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    raw = await read_answer(stream)
    await stream.aclose()
    ((status, headers, body),) = h11_answers(raw, 1)
    return status, _comparable(headers), body


def _health_request(*headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n{extra}\r\n".encode()


@pytest.mark.parametrize(
    ("settings", "headers", "stop", "drain"),
    [
        (make_settings(), (), None, False),
        (make_settings(), ("x-request-id: probe-7",), None, False),
        (
            ServeSettings(
                deployments=make_settings().deployments, allowed_origins=("https://ui.example",)
            ),
            ("origin: https://ui.example",),
            None,
            False,
        ),
        (make_settings(GPT, LLAMA), (), GPT, False),
        (make_settings(), (), None, True),
    ],
    ids=["ok", "request-id", "cors", "engine-stopped", "draining"],
)
async def test_the_quick_answer_is_the_routes(
    settings: ServeSettings, headers: tuple[str, ...], stop: str | None, drain: bool
) -> None:
    """health Rule 2: the answer written by the connection (quick) and the route's answer
    to the same request (the same request with a query, which the quick path leaves)
    agree on status, body and headers (but the date): 200, the client's request id,
    CORS for an allowed origin, 503 naming a stopped engine with Retry-After, 503 once a
    shutdown began."""
    with trio.fail_after(30):
        async with running_server(settings) as (_, port, state):
            if stop is not None:
                state.runtimes[stop].kill()
            if drain:
                state.draining = True
            quick = await _on_the_wire(port, _health_request(*headers))
            routed_request = _health_request(*headers).replace(b"/health", b"/health?via=route")
            routed = await _on_the_wire(port, routed_request)
            state.draining = False
    assert quick == routed
    status, got, body = quick
    if stop is not None:
        assert status == 503 and b"retry-after" in got
        assert json.loads(body)["models"] == {GPT: "stopped", LLAMA: "running"}
    elif drain:
        assert status == 503
    else:
        assert (status, body) == (200, b'{"status":"ok"}')
    if headers and headers[0].startswith("x-request-id"):
        assert got[b"x-request-id"] == b"probe-7"
    if headers and headers[0].startswith("origin"):
        assert got[b"access-control-allow-origin"] == b"https://ui.example"


async def test_requests_the_quick_path_leaves_are_answered_the_usual_way() -> None:
    """quick Rule 1: two pipelined ``/health`` in one write, HTTP/1.0 and HEAD are
    answered by hypercorn and the route as before; a quick answer leaves the connection
    idle for the next request; with ``Connection: close`` (a kubelet's probe) the quick
    answer says so and the connection is closed."""
    health = _health_request()
    with trio.fail_after(30):
        async with running_server(make_settings()) as (_, port, _state):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(health + health)
            raw = await read_answer(stream)
            while raw.count(b'{"status":"ok"}') < 2:
                raw += await stream.receive_some(65536)
            assert [a[0] for a in h11_answers(raw, 2)] == [200, 200]
            await stream.send_all(health)  # quick, then a routed request on the same line
            assert (await read_answer(stream)).endswith(b'{"status":"ok"}')
            await stream.send_all(http_request("GET", "/v1/models"))
            assert b'"object":"list"' in await read_answer(stream)
            await stream.aclose()
            for request in (
                http_request("GET", "/health", close=True),
                b"GET /health HTTP/1.0\r\nhost: 127.0.0.1\r\n\r\n",
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(request)
                raw = await read_until_eof(stream)  # the server closes these
                assert raw.split(b"\r\n")[0].endswith(b"200 ") and raw.endswith(b'ok"}')
                assert b"\r\nconnection: close\r\n" in raw.lower()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"HEAD /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(65536)
            assert head.startswith(b"HTTP/1.1 200 ")
            await stream.aclose()


async def test_an_idle_connection_after_a_quick_answer_is_closed_without_a_408() -> None:
    """quick Rule 2: the idle timer restarts after a quick answer as after any request, so
    once keep_alive_timeout passes the connection is closed quietly; a timer that missed
    the read would take it for a request head that never ended and answer 408."""
    with trio.fail_after(30):
        async with running_server(make_settings(), keep_alive_timeout=1.0) as (_, port, _s):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(_health_request())
            first = await read_answer(stream)
            rest = await read_until_eof(stream)
            await stream.aclose()
    assert first.startswith(b"HTTP/1.1 200 ") and rest == b""
