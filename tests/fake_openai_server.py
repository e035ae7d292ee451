"""A tiny OpenAI-ish HTTP server for client tests: raw trio + h11 over any trio stream.

Two ways to reach it:

- in memory (most tests): ``fake = MemoryFake(nursery, FakeConfig(...))`` gives
  ``fake.connect``, a ``ConnectionPool`` connect function that opens trio.testing memory
  streams to the fake (pass it as ``run_load(..., connect=fake.connect)``); with pytest-trio's
  ``autojump_clock`` the load then runs on virtual time: a 0.2 s token delay takes
  microseconds and times are exact.
- over TCP (tests of the synchronous CLI): ``server = await nursery.start(serve_fake_openai,
  FakeConfig(...))`` serves on 127.0.0.1:0 and returns a ``FakeServer`` with the ``url``.

It speaks the server's wire format (role frame, one frame per token, finish frame, optional
usage frame, ``[DONE]``; the 529 ``overloaded_error`` body) and counts prompt tokens the
server's way, so a client test checks the client against the format the real server sends.

Behaviour is scripted, not simulated:
- ``script``: statuses for successive requests in arrival order (200, 529, 503, any other
  code, or ``DROP`` to close the connection without answering); once it runs out,
  ``default_status`` applies.
- ``capacity``: a request arriving while ``capacity`` 200 responses are in progress gets
  529 — the overload a real server with ``max_waiting = 0`` and no queue would give.
- ``token_delay``: seconds between tokens (real time: this paces the fake's work, it is not
  test synchronisation).
- ``fail_after_tokens``: a 200 stream sends this many tokens, then the ``engine_failed``
  error frame and ``[DONE]``.
- ``close_connections`` answers with ``connection: close``; ``close_idle`` closes the
  connection after each answer without saying so (a keep-alive time-out on the server).
- ``retry_after``: the ``Retry-After`` value sent with every 429, 503 and 529 (none when
  None).
- ``pacing_lags``: ``inference-lab-pacing-lag-ms`` values, one per completion request in
  turn (cycled), sent with every answer (none when empty).
- ``GET /v1/models`` lists ``models`` (answered ``models_status`` when that is not 200);
  it is counted apart (``FakeStats.model_lists``), never in the completion counters.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import trio
import trio.testing

from inference_lab.client.http import Origin, Transport

WORDS = (
    "the of and to in a is that for it was on are be with as at this have from or an by not "
    "but what all were when we there can which their if do will each about how up out them "
    "then she many some so these would"
).split()

DROP = 0
"""Script entry: read the request, then close the connection without a response."""

_OVERLOAD_BODY = (
    b'{"error":{"message":"Server is at capacity: 1 requests waiting (max_waiting = 1). '
    b'Retry with reduced concurrency.","type":"overloaded_error","code":"queue_saturated"}}'
)


@attrs.frozen(kw_only=True)
class FakeConfig:
    script: Sequence[int] = ()
    default_status: int = 200
    capacity: int | None = None
    token_delay: float = 0.0
    tokens: int | None = None
    """Tokens per answer; None = the request's ``max_tokens``."""
    fail_after_tokens: int | None = None
    close_connections: bool = False
    """Answer with ``connection: close`` (no keep-alive)."""
    close_idle: bool = False
    """Close the connection after each answer, without a ``connection: close`` header."""
    retry_after: str | None = None
    pacing_lags: Sequence[str] = ()
    models: Sequence[str] = ("m",)
    models_status: int = 200


@attrs.define
class FakeStats:
    requests: int = 0
    statuses: Counter[int] = attrs.Factory(Counter)
    active: int = 0
    max_active: int = 0
    connections: int = 0
    bodies: list[dict[str, Any]] = attrs.Factory(list)
    targets: list[str] = attrs.Factory(list)
    hosts: list[str] = attrs.Factory(list)
    origins: list[str] = attrs.Factory(list)
    """In memory: the origin of every connect call."""
    model_lists: list[str] = attrs.Factory(list)
    """The target of every ``GET`` (the model list), in order."""


@attrs.frozen
class FakeServer:
    port: int
    stats: FakeStats

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
    return max(1, math.ceil(len(text.encode()) / 4) * 105 // 100)


def _wire(conn: h11.Connection, *events: h11.Event) -> bytes:
    return b"".join(conn.send(e) or b"" for e in events)


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Handler:
    def __init__(self, config: FakeConfig, stats: FakeStats) -> None:
        self.config = config
        self.stats = stats
        self.script = deque(config.script)

    async def __call__(self, stream: trio.abc.Stream) -> None:
        self.stats.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                keep = await self._answer(stream, conn, request, body)
                if not keep or self.config.close_idle or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return  # the client went away: nothing to clean up in a fake
        finally:
            await stream.aclose()

    async def _read_request(
        self, stream: trio.abc.Stream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            else:  # ConnectionClosed or PAUSED
                return None, b""

    async def _answer(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> bool:
        stats = self.stats
        cfg = self.config
        if request.method == b"GET":
            return await self._list_models(stream, conn, request)
        stats.requests += 1
        stats.targets.append(request.target.decode())
        stats.hosts.append(dict(request.headers).get(b"host", b"").decode())
        payload: dict[str, Any] = json.loads(body)
        stats.bodies.append(payload)
        status = self.script.popleft() if self.script else cfg.default_status
        if status == 200 and cfg.capacity is not None and stats.active >= cfg.capacity:
            status = 529
        if status == DROP:
            stats.statuses[DROP] += 1
            return False
        stats.statuses[status] += 1
        headers = [("content-type", "application/json")]
        if cfg.close_connections:
            headers.append(("connection", "close"))
        if cfg.pacing_lags:
            lag = cfg.pacing_lags[(stats.requests - 1) % len(cfg.pacing_lags)]
            headers.append(("inference-lab-pacing-lag-ms", lag))
        if status != 200:
            if cfg.retry_after is not None and status in (429, 503, 529):
                headers.append(("retry-after", cfg.retry_after))
            if status == 529:
                out = _OVERLOAD_BODY
                headers.append(("x-should-retry", "false"))
            else:
                out = json.dumps(
                    {
                        "error": {
                            "message": f"fake {status}",
                            "type": "service_unavailable_error"
                            if status == 503
                            else "invalid_request_error",
                            "param": None,
                            "code": f"fake_{status}",
                        }
                    }
                ).encode()
            headers.append(("content-length", str(len(out))))
            await stream.send_all(
                _wire(
                    conn,
                    h11.Response(status_code=status, headers=headers),
                    h11.Data(data=out),
                    h11.EndOfMessage(),
                )
            )
            return True
        stats.active += 1
        stats.max_active = max(stats.max_active, stats.active)
        try:
            await self._stream_answer(stream, conn, request, payload, headers)
        finally:
            stats.active -= 1
        return True

    async def _list_models(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request
    ) -> bool:
        cfg = self.config
        self.stats.model_lists.append(request.target.decode())
        if cfg.models_status != 200:
            body: dict[str, Any] = {
                "error": {
                    "message": f"fake {cfg.models_status}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": f"fake_{cfg.models_status}",
                }
            }
        else:
            data = [{"id": m, "object": "model", "owned_by": "fake"} for m in cfg.models]
            body = {"object": "list", "data": data}
        out = json.dumps(body).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(out)))]
        await stream.send_all(
            _wire(
                conn,
                h11.Response(status_code=cfg.models_status, headers=headers),
                h11.Data(data=out),
                h11.EndOfMessage(),
            )
        )
        return True

    async def _stream_answer(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        payload: dict[str, Any],
        headers: list[tuple[str, str]],
    ) -> None:
        cfg = self.config
        chat = request.target.endswith(b"/chat/completions")
        max_tokens = int(payload.get("max_tokens", 16))
        n = cfg.tokens if cfg.tokens is not None else max_tokens
        if chat:
            prompt = chat_prompt_tokens(payload["messages"])
        else:
            prompt = max(1, math.ceil(len(str(payload["prompt"]).encode()) / 4))
        finish = "length" if n >= max_tokens else "stop"
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        base: dict[str, Any] = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1700000000,
            "model": payload["model"],
        }
        if not payload.get("stream"):
            text = "".join(WORDS[i % len(WORDS)] + " " for i in range(n)).rstrip()
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"text": text, "index": 0}
            )
            choice["finish_reason"] = finish
            out = json.dumps({**base, "choices": [choice], "usage": usage}).encode()
            headers = [*headers, ("content-length", str(len(out)))]
            await stream.send_all(
                _wire(
                    conn,
                    h11.Response(status_code=200, headers=headers),
                    h11.Data(data=out),
                    h11.EndOfMessage(),
                )
            )
            return
        headers = [(k, v) for k, v in headers if k != "content-type"]
        headers.append(("content-type", "text/event-stream"))
        out = _wire(conn, h11.Response(status_code=200, headers=headers))
        if chat:
            role = {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            out += _wire(conn, h11.Data(data=_frame(role)))
        await stream.send_all(out)
        for i in range(n):
            if cfg.fail_after_tokens is not None and i == cfg.fail_after_tokens:
                err = {
                    "error": {
                        "message": "engine failed",
                        "type": "server_error",
                        "param": None,
                        "code": "engine_failed",
                    }
                }
                await stream.send_all(
                    _wire(
                        conn, h11.Data(data=_frame(err) + b"data: [DONE]\n\n"), h11.EndOfMessage()
                    )
                )
                return
            if cfg.token_delay > 0:
                await trio.sleep(cfg.token_delay)
            word = WORDS[i % len(WORDS)] + " "
            tok: dict[str, Any] = (
                {"index": 0, "delta": {"content": word}} if chat else {"text": word, "index": 0}
            )
            await stream.send_all(_wire(conn, h11.Data(data=_frame({**base, "choices": [tok]}))))
        fin: dict[str, Any] = (
            {"index": 0, "delta": {}, "finish_reason": finish}
            if chat
            else {"text": "", "index": 0, "finish_reason": finish}
        )
        tail = _frame({**base, "choices": [fin]})
        if (payload.get("stream_options") or {}).get("include_usage"):
            tail += _frame({**base, "choices": [], "usage": usage})
        tail += b"data: [DONE]\n\n"
        await stream.send_all(_wire(conn, h11.Data(data=tail), h11.EndOfMessage()))


class MemoryTransport:
    """The client's end of an in-memory connection to the fake (an ``http.Transport``)."""

    def __init__(
        self,
        to_server: trio.testing.MemorySendStream,
        from_server: trio.testing.MemoryReceiveStream,
    ) -> None:
        self._send = to_server
        self._receive = from_server
        self.peer_closed = False
        """Set when the fake closes its end: then a read would return EOF at once."""

    async def send_all(self, data: bytes) -> None:
        await self._send.send_all(data)

    async def receive_some(self, max_bytes: int) -> bytes:
        return bytes(await self._receive.receive_some(max_bytes))

    def is_readable(self) -> bool:
        # The fake never sends unasked bytes, so only its close makes an idle connection
        # readable.
        return self.peer_closed

    def last_receipt(self) -> float | None:
        return None  # a memory stream has no kernel to stamp its bytes

    def close(self) -> None:
        self._send.close()
        self._receive.close()


class MemoryFake:
    """The fake served over trio.testing memory streams, one handler task per connection
    in ``nursery``; ``connect`` is the ``ConnectionPool`` connect function that reaches it."""

    def __init__(self, nursery: trio.Nursery, config: FakeConfig | None = None) -> None:
        self.stats = FakeStats()
        self._handler = _Handler(config or FakeConfig(), self.stats)
        self._nursery = nursery

    async def connect(self, origin: Origin) -> Transport:
        self.stats.origins.append(str(origin))
        to_server, server_receive = trio.testing.memory_stream_one_way_pair()
        server_send, from_server = trio.testing.memory_stream_one_way_pair()
        transport = MemoryTransport(to_server, from_server)
        pump = server_send.close_hook

        def closed() -> None:
            if pump is not None:
                pump()  # delivers the EOF
            transport.peer_closed = True

        server_send.close_hook = closed
        self._nursery.start_soon(self._handler, trio.StapledStream(server_send, server_receive))
        await trio.lowlevel.checkpoint()
        return transport


async def serve_fake_openai(
    config: FakeConfig | None = None,
    *,
    task_status: trio.TaskStatus[FakeServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started`` gets the ``FakeServer``."""
    stats = FakeStats()
    handler = _Handler(config or FakeConfig(), stats)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), handler, 0
        )
        port = listeners[0].socket.getsockname()[1]
        task_status.started(FakeServer(port, stats))
