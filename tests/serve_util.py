"""The production path in tests: the app served on a real socket, and a client for it.

:func:`serving` is the one way the tests serve an app on ``127.0.0.1:0``: as
``inference-lab serve`` serves it (``serve_app`` on a ``bind_socket`` socket: hypercorn's
trio worker with the transport's hooks), in this process. :class:`SocketServed` offers
over that socket what ``tests/conftest.py``'s in-memory ``Served`` offers over Quart's
test client (``post``, ``get_json``, ``stream``), so a test written against one runs
through both (the ``serve_both`` fixture). Never with the autojump clock.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio.testing

from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve import ServeSettings, ServeState, create_app, get_state
from inference_lab.serve.server import bind_socket, serve_app

__all__ = [
    "Answer",
    "SocketExchange",
    "SocketServed",
    "StreamFrames",
    "assert_idle",
    "http_request",
    "post_closing",
    "read_until_eof",
    "running_server",
    "serving",
    "split_frames",
]


@asynccontextmanager
async def serving(app: Any, **serve_kwargs: Any) -> AsyncIterator[int]:
    """``app`` served as ``inference-lab serve`` serves it, on 127.0.0.1 (``serve_kwargs``
    go to ``serve_app``; a ``backlog`` to ``bind_socket`` as well): its port. The server
    is shut down on the way out."""
    stop = trio.Event()
    backlog = serve_kwargs.get("backlog")
    async with trio.open_nursery() as nursery:
        sock = (
            bind_socket("127.0.0.1", 0) if backlog is None else bind_socket("127.0.0.1", 0, backlog)
        )
        port = int(sock.getsockname()[1])  # (the server takes the socket over)
        await nursery.start(
            lambda task_status: serve_app(
                app, sock, shutdown_trigger=stop.wait, task_status=task_status, **serve_kwargs
            )
        )
        try:
            yield port
        finally:
            stop.set()


@asynccontextmanager
async def running_server(
    settings: ServeSettings, **serve_kwargs: Any
) -> AsyncIterator[tuple[str, int, ServeState]]:
    """A fresh app for ``settings`` served by :func:`serving`: (base URL, port, state)."""
    app = create_app(settings)
    async with serving(app, **serve_kwargs) as port:
        yield f"http://127.0.0.1:{port}", port, get_state(app)


async def read_until_eof(stream: trio.SocketStream) -> bytes:
    data = bytearray()
    while chunk := await stream.receive_some(65536):
        data += chunk
    return bytes(data)


def http_request(method: str, path: str, body: Any = None, *, close: bool = False) -> bytes:
    """A request as bytes on the wire (a JSON body when ``body`` is given)."""
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(payload)}\r\n"
    if payload:
        head += "content-type: application/json\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + payload


def post_closing(body: dict[str, Any], path: bytes = b"/v1/completions") -> bytes:
    """A ``Connection: close`` POST of ``body`` as JSON."""
    return http_request("POST", path.decode(), body, close=True)


def split_frames(data: bytes) -> list[bytes]:
    """The payloads of an SSE byte stream, asserting each event is exactly
    ``data: <payload>\\n\\n``."""
    assert data.endswith(b"\n\n"), data[-80:]
    events = data[:-2].split(b"\n\n")
    payloads = []
    for event in events:
        assert event.startswith(b"data: "), event
        assert b"\n" not in event, event
        payloads.append(event[len(b"data: ") :])
    return payloads


def assert_idle(rt: ModelRuntime) -> None:
    """No KV block, batch slot, queue slot or pending slot is held."""
    st = rt.engine.statistics()
    assert (st.kv_used_blocks, st.running, st.waiting, st.pending_arrivals) == (0, 0, 0, 0)
    snap = rt.snapshot()
    assert (snap.running, snap.waiting, snap.pending, snap.depth) == (0, 0, 0, 0)


class StreamFrames:
    """What a test reads of one answer's body, however it came: ``chunks`` holds (arrival
    time, data) per body write of the server."""

    chunks: list[tuple[float, bytes]]

    async def next_chunk(self) -> bytes | None:
        raise NotImplementedError

    async def read_all(self) -> list[tuple[float, bytes]]:
        while await self.next_chunk() is not None:
            pass
        return self.chunks

    async def next_frames(self) -> list[bytes]:
        data = await self.next_chunk()
        assert data is not None, "the stream ended"
        return split_frames(data)

    def body_bytes(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    def frames(self) -> list[bytes]:
        return split_frames(self.body_bytes())

    def frame_times(self) -> list[tuple[float, dict[str, Any] | str]]:
        """(arrival time, decoded payload) per frame; ``[DONE]`` stays a string."""
        out: list[tuple[float, dict[str, Any] | str]] = []
        for t, data in self.chunks:
            for payload in split_frames(data):
                out.append((t, "[DONE]" if payload == b"[DONE]" else json.loads(payload)))
        return out

    def token_times(self) -> list[float]:
        """Arrival times of the content frames (one per token)."""
        times = []
        for t, frame in self.frame_times():
            if isinstance(frame, dict) and frame.get("choices"):
                choice = frame["choices"][0]
                if choice.get("delta", {}).get("content") or (
                    choice.get("text") and "finish_reason" not in choice
                ):
                    times.append(t)
        return times


class SocketExchange(StreamFrames):
    """One request on its own connection to a served app, read with h11's client: a body
    chunk of the server's (one chunk of a chunked body, as the server writes one per
    write) is one entry of ``chunks``. ``disconnect`` closes the connection."""

    def __init__(
        self,
        port: int,
        method: str,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.port = port
        self.method = method
        self.path = path
        self.body = body
        self.extra_headers = list(headers)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[tuple[float, bytes]] = []
        self.ended = False
        self._h11 = h11.Connection(h11.CLIENT)
        self._stream: trio.SocketStream | None = None
        self._partial = b""

    async def start(self) -> None:
        """Connect and send the request."""
        self._stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        headers = [(b"host", b"127.0.0.1"), (b"content-length", b"%d" % len(self.body))]
        named = {name.lower() for name, _ in self.extra_headers}
        if self.body and b"content-type" not in named:
            headers.append((b"content-type", b"application/json"))
        request = h11.Request(
            method=self.method, target=self.path, headers=headers + self.extra_headers
        )
        data = self._h11.send(request) or b""
        if self.body:
            data += self._h11.send(h11.Data(data=self.body)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        try:
            await self._stream.send_all(data)
        except trio.BrokenResourceError:
            pass  # answered and closed before the whole body was read (a 413): read on

    async def _event(self) -> Any:
        assert self._stream is not None
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self._stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""  # a reset after the answer: the end of the connection
            self._h11.receive_data(data)

    async def next_chunk(self) -> bytes | None:
        """The next body write of the server (None once the body is complete)."""
        while not self.ended:
            event = await self._event()
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                self._partial += bytes(event.data)
                if event.chunk_end or "transfer-encoding" not in self.headers:
                    data, self._partial = self._partial, b""
                    if data:
                        self.chunks.append((trio.current_time(), data))
                        return data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self.ended = True
        return None

    async def disconnect(self) -> None:
        """The client goes away: the connection is closed (the server reads its end)."""
        self.ended = True
        await self.close()
        await trio.testing.wait_all_tasks_blocked()

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None


@attrs.frozen
class Answer:
    """A whole answer: what tests read of Quart's test response, from a socket."""

    status_code: int
    headers: dict[str, str]
    data: bytes

    async def get_data(self) -> bytes:
        return self.data


@attrs.define
class SocketServed:
    """A running app served on a real socket (:func:`serving`): ``tests/conftest.py``'s
    ``Served`` over the production path."""

    app: Any
    port: int
    state: ServeState

    def runtime(self, name: str | None = None) -> ModelRuntime:
        """The named model's runtime (default: the first model served)."""
        if name is None:
            return next(iter(self.state.runtimes.values()))
        return self.state.runtimes[name]

    async def request(
        self,
        method: str,
        path: str,
        data: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Answer:
        exchange = SocketExchange(self.port, method, path, data, headers)
        await exchange.start()
        try:
            await exchange.read_all()
        finally:
            await exchange.close()
        assert exchange.status is not None
        return Answer(exchange.status, exchange.headers, exchange.body_bytes())

    async def post(self, path: str, body: Any) -> Answer:
        return await self.request("POST", path, json.dumps(body).encode())

    async def post_raw(
        self, path: str, data: bytes, content_type: str = "application/json"
    ) -> Answer:
        """POST ``data`` as it is, declared as ``content_type``."""
        return await self.request("POST", path, data, [(b"content-type", content_type.encode())])

    async def get_json(self, path: str) -> tuple[int, Any]:
        answer = await self.request("GET", path)
        return answer.status_code, json.loads(answer.data)

    @asynccontextmanager
    async def stream(
        self,
        body: dict[str, Any],
        path: str = "/v1/chat/completions",
        window: int = 10,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> AsyncIterator[SocketExchange]:
        """Send ``body`` (streaming or not) on a connection of its own. Leaving the block
        before the response is complete disconnects the client. (``window``: the socket's
        own buffers stand for it.)"""
        exchange = SocketExchange(self.port, "POST", path, json.dumps(body).encode(), headers)
        await exchange.start()
        try:
            yield exchange
        finally:
            with trio.CancelScope(shield=True):
                if exchange.ended:
                    await exchange.close()
                else:
                    await exchange.disconnect()
