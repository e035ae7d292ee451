"""hypercorn's HTTP/1.1 protocol with the short path for response starts
(inference_lab/serve/transport/protocol.py): the same bytes and h11 state as h11's own way (Rule 2),
and h11's own way wherever the short path does not apply (Rule 1)."""

from __future__ import annotations

import time
from typing import Any

import h11
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from inference_lab.serve.responses import STREAM_HEADERS as SERVED_STREAM_HEADERS
from inference_lab.serve.transport.connection import local_connection
from inference_lab.serve.transport.protocol import LabH11Protocol, adopt, server_headers

POST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 2\r\n\r\n{}"
)
GET = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
STREAM_HEADERS = [*SERVED_STREAM_HEADERS, (b"x-request-id", b"cmpl-0123456789abcdef")]
JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"5")]


def protocol(cls: type[H11Protocol], request: bytes, config: Config) -> tuple[Any, list[bytes]]:
    """A ``cls`` protocol whose h11 connection has read ``request`` (and nothing else of
    it has run), and the list its writes go to."""
    written: list[bytes] = []

    async def send(event: Any) -> None:
        if isinstance(event, RawData):
            written.append(event.data)

    proto = cls(
        None, config, WorkerContext(None), None, ConnectionState({}), False, None, None, send
    )  # type: ignore[arg-type]
    proto.connection.receive_data(request)
    while proto.connection.next_event() not in (h11.NEED_DATA, h11.PAUSED):
        pass
    proto.keep_alive_requests = 1
    return proto, written


def quiet_config() -> Config:
    """hypercorn's configuration without the date header (a second's boundary between
    the two ways would differ)."""
    config = Config()
    config.include_date_header = False
    return config


def state(proto: Any) -> tuple[Any, ...]:
    connection = proto.connection
    return (
        connection.our_state,
        connection.their_state,
        connection._cstate.keep_alive,
        type(connection._writer).__name__,
    )


async def both_ways(
    request: bytes, status: int, headers: list[tuple[bytes, bytes]], config: Config
) -> tuple[tuple[Any, list[bytes]], tuple[Any, list[bytes]]]:
    """The same response start, a body and its end, sent by hypercorn's protocol and by
    ours over connections that read the same request."""
    ours = protocol(LabH11Protocol, request, config)
    theirs = protocol(H11Protocol, request, config)
    for proto, _ in (ours, theirs):
        await proto.stream_send(Response(stream_id=1, status_code=status, headers=headers))
    return ours, theirs


@pytest.mark.parametrize(
    ("request_bytes", "status", "headers"),
    [
        (POST, 200, STREAM_HEADERS),  # chunked: Transfer-Encoding added
        (POST, 200, JSON_HEADERS),  # framed by its length
        (POST, 400, JSON_HEADERS),
        (POST, 529, [*JSON_HEADERS, (b"retry-after", b"1")]),
        (GET, 200, [(b"Content-Type", b"text/plain")]),  # a raw name's case is kept
        (GET, 503, []),
    ],
    ids=["stream", "json", "400", "529", "raw-case", "empty"],
)
async def test_the_short_path_writes_what_h11_writes(
    request_bytes: bytes, status: int, headers: list[tuple[bytes, bytes]]
) -> None:
    (ours, our_bytes), (theirs, their_bytes) = await both_ways(
        request_bytes, status, headers, quiet_config()
    )
    assert our_bytes == their_bytes and len(our_bytes) == 1
    assert state(ours) == state(theirs) == (h11.SEND_BODY, h11.DONE, True, state(theirs)[3])
    for proto in (ours, theirs):
        await proto.stream_send(Body(stream_id=1, data=b"hello"))
        await proto.stream_send(EndBody(stream_id=1))
    assert our_bytes == their_bytes
    assert state(ours)[:3] == state(theirs)[:3] == (h11.DONE, h11.DONE, True)


async def test_the_short_path_keeps_hypercorns_date_and_server_headers() -> None:
    (ours, written), _ = await both_ways(POST, 200, STREAM_HEADERS, Config())
    head = written[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 200 "
    names = [line.split(b":")[0] for line in head[1:] if line]
    assert names == [
        b"content-type",
        b"cache-control",
        b"x-request-id",
        b"date",
        b"server",
        b"Transfer-Encoding",
    ]


async def test_a_plain_start_does_not_go_through_h11s_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the short path every start is an ``h11.Response`` handed to ``send``."""
    sent: list[str] = []
    plain_send = h11.Connection.send

    def recording_send(self: h11.Connection, event: Any) -> bytes | None:
        sent.append(type(event).__name__)
        return plain_send(self, event)

    monkeypatch.setattr(h11.Connection, "send", recording_send)
    await both_ways(POST, 200, STREAM_HEADERS, quiet_config())
    assert sent == ["Response"]  # hypercorn's protocol's only


def _bad_config() -> Config:
    config = quiet_config()
    config.keep_alive_max_requests = 1
    return config


@pytest.mark.parametrize(
    ("request_bytes", "status", "headers", "config", "why"),
    [
        (POST.replace(b"POST", b"HEAD", 1), 200, STREAM_HEADERS, None, "HEAD frames its own way"),
        (POST.replace(b"HTTP/1.1", b"HTTP/1.0", 1), 200, STREAM_HEADERS, None, "HTTP/1.0"),
        (POST.replace(b"host: x", b"host: x\r\nconnection: close"), 200, [], None, "closing"),
        (POST, 200, [(b"connection", b"close")], None, "the app closes the connection"),
        (POST, 200, [(b"transfer-encoding", b"chunked")], None, "the app frames its body"),
        (POST, 204, [], None, "no body"),
        (POST, 304, [], None, "no body"),
        (POST, 200, [], _bad_config(), "hypercorn's request limit adds connection: close"),
    ],
    ids=["head", "http10", "client-closes", "app-closes", "app-frames", "204", "304", "limit"],
)
async def test_h11s_own_way_where_its_choice_is_not_plain(
    request_bytes: bytes,
    status: int,
    headers: list[tuple[bytes, bytes]],
    config: Config | None,
    why: str,
) -> None:
    config = config or quiet_config()
    proto, _ = protocol(LabH11Protocol, request_bytes, config)
    before = state(proto)
    assert proto.response_start(Response(stream_id=1, status_code=status, headers=headers)) is None
    assert state(proto) == before, why
    (ours, our_bytes), (theirs, their_bytes) = await both_ways(
        request_bytes, status, headers, config
    )
    assert our_bytes == their_bytes and state(ours) == state(theirs), why


async def test_headers_h11_refuses_are_refused_as_h11_refuses_them() -> None:
    bad = [(b"x-bad", b"one\r\ntwo")]
    for cls in (LabH11Protocol, H11Protocol):
        proto, written = protocol(cls, POST, quiet_config())
        with pytest.raises(h11.LocalProtocolError, match="Illegal header value"):
            await proto.stream_send(Response(stream_id=1, status_code=200, headers=bad))
        assert written == []


def test_adopt_switches_only_hypercorns_http11_protocol() -> None:
    proto, _ = protocol(H11Protocol, POST, quiet_config())
    adopt(proto)
    assert type(proto) is LabH11Protocol
    other = object()
    adopt(other)
    assert type(other) is object


async def test_a_hooked_connection_serves_with_the_short_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts: list[bytes | None] = []
    plain = LabH11Protocol.response_start

    def recording(self: LabH11Protocol, event: Response) -> bytes | None:
        starts.append(plain(self, event))
        return starts[-1]

    monkeypatch.setattr(LabH11Protocol, "response_start", recording)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": False})

    server, client = local_connection(app)
    answer = b""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            await client.send_all(POST)
            while not answer.endswith(b"0\r\n\r\n"):
                answer += await client.receive_some(4096)
            await client.aclose()
    assert len(starts) == 1 and starts[0] is not None and answer.startswith(starts[0])
    assert answer.endswith(b"9\r\ndata: x\n\n\r\n0\r\n\r\n")


def test_hypercorns_headers_are_built_once_a_second_per_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    class Fake:
        def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
            calls.append(1)
            return [(b"Date", b"call %d" % len(calls))]

    now = [1000.2]
    monkeypatch.setattr(time, "time", lambda: now[0])
    first, other = Fake(), Fake()
    assert server_headers(first) == [(b"Date", b"date", b"call 1")]
    now[0] = 1000.9
    assert server_headers(first) == [(b"Date", b"date", b"call 1")]  # the same second
    now[0] = 1001.0
    assert server_headers(first) == [(b"Date", b"date", b"call 2")]
    assert server_headers(other) == [(b"Date", b"date", b"call 3")]
    assert len(calls) == 3
