"""The proxy's exchanges with a backend (``proxy/backends.py``) against a scripted backend
on a real socket (127.0.0.1, under ``trio.fail_after``): its connections are opened
without the kernel's receive timestamps (Rule 4), and a relayed answer's pieces pass as
they arrive while a backend silent mid-answer is a :class:`BackendFailed` (Rule 3)."""

from __future__ import annotations

import socket

import pytest
import trio

from inference_lab.client import http
from inference_lab.client.http import Origin, TCPTransport, connect_tcp, connect_tcp_unstamped
from inference_lab.proxy.backends import BackendFailed, Exchange, Pool
from inference_lab.socket_stamps import SO_TIMESTAMPNS

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def scripted_backend(
    listener: trio.socket.SocketType, pieces: list[bytes], pause: float
) -> None:
    """Accept one connection, read its request, send ``pieces`` ``pause`` seconds apart,
    then wait (a backend that stays silent) until cancelled."""
    conn, _ = await listener.accept()
    with conn:
        assert await conn.recv(65536)
        for piece in pieces:
            await conn.send(piece)
            await trio.sleep(pause)
        await trio.sleep_forever()


async def listening() -> tuple[trio.socket.SocketType, Origin]:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    host, port = listener.getsockname()
    return listener, Origin(host=host, port=port)


async def test_backend_connections_are_not_stamped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 4: a pool made as the proxy makes it opens its connections without asking the
    kernel for receive timestamps (the proxy reads none), and its answers still arrive."""
    asked: list[int] = []
    plain = http.enable_receive_timestamps

    def spy(sock: socket.socket) -> bool:
        asked.append(sock.fileno())
        return plain(sock)

    monkeypatch.setattr(http, "enable_receive_timestamps", spy)
    listener, origin = await listening()
    pool = Pool("decode", [origin], "round_robin")
    (backend,) = pool.backends
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scripted_backend, listener, [HEAD + chunk(b"a") + b"0\r\n\r\n"], 0)
            async with Exchange(backend, 5.0, "GET", "/", []) as answer:
                assert answer.status == 200
                assert await answer.body(100) == b"a"
            nursery.cancel_scope.cancel()
    pool.close()
    listener.close()
    assert asked == []


@pytest.mark.skipif(SO_TIMESTAMPNS is None, reason="no kernel receive timestamps here")
async def test_an_unstamped_transport_leaves_the_socket_unstamped() -> None:
    """``connect_tcp_unstamped`` leaves ``SO_TIMESTAMPNS`` off (``connect_tcp`` turns it
    on), and its reads carry no kernel stamp."""
    listener, origin = await listening()
    with trio.fail_after(10):
        stamped = await connect_tcp(origin)
        unstamped = await connect_tcp_unstamped(origin)
        accepted = [(await listener.accept())[0] for _ in range(2)]
        assert isinstance(stamped, TCPTransport) and isinstance(unstamped, TCPTransport)
        options = [
            t._stream.socket.getsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS)
            for t in (stamped, unstamped)
        ]
        await accepted[1].send(b"hi")
        assert await unstamped.receive_some(10) == b"hi"
        assert unstamped.last_receipt() is None
    for sock in accepted:
        sock.close()
    stamped.close()
    unstamped.close()
    listener.close()
    assert options[0] != 0 and options[1] == 0


async def test_pieces_pass_as_they_arrive_and_a_silent_backend_fails() -> None:
    """Rule 3: each piece of an answer is handed on when it arrives (the wait for each
    bounded by the timeout from the previous one, not from the request); a backend silent
    for the timeout mid-answer is a :class:`BackendFailed` saying so."""
    listener, origin = await listening()
    pool = Pool("decode", [origin], "round_robin")
    (backend,) = pool.backends
    pieces = [HEAD + chunk(b"a"), chunk(b"b"), chunk(b"c"), chunk(b"d")]
    got: list[bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scripted_backend, listener, pieces, 0.4)
            with pytest.raises(BackendFailed, match=r"silent for 1 s mid-answer"):
                async with Exchange(backend, 1.0, "GET", "/", []) as answer:
                    while not answer.ended:
                        got.append(await answer.chunk())
            nursery.cancel_scope.cancel()
    pool.close()
    listener.close()
    assert got == [b"a", b"b", b"c", b"d"]  # 1.2 s in all, each within 1 s of the last
    assert backend.failures == 1 and backend.outstanding == 0
