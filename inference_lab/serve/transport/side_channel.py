"""The server's own outgoing HTTP: small JSON POSTs to a peer server (a decode server's
claims and releases of a prefill server's KV, ``serve/kv_transfer.py``).

h11 over a trio TCP stream, with idle keep-alive connections kept per peer, so a decode
server under load pays a connection once per peer, not once per request.

Rule 1: every call is bounded: connecting, sending and reading the answer together take at
        most the channel's ``timeout``, and an answer body at most ``max_body`` bytes; a
        peer that does not answer in time, refuses the connection, breaks the protocol or
        says too much is a :class:`PeerUnavailable`, never another exception.
Rule 2: a connection goes back to the idle list only when h11 says both sides are done
        and the peer did not ask to close; an idle connection with something to read (the
        peer closed it) is dropped before it is reused.
Rule 3: :meth:`SideChannel.close` is synchronous and closes every idle connection.
"""

from __future__ import annotations

import attrs
import h11
import trio

__all__ = ["PeerAnswer", "PeerUnavailable", "SideChannel"]

#: Bytes asked of the socket per read.
_RECEIVE = 65536
#: Idle connections kept per peer.
_MAX_IDLE = 64
_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


class PeerUnavailable(Exception):
    """The peer could not be reached or did not answer properly (Rule 1); ``str()`` is a
    one-line reason."""


@attrs.frozen
class PeerAnswer:
    """A peer's answer: its status and its whole body."""

    status: int
    body: bytes


class _Connection:
    __slots__ = ("stream", "h11")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.stream.socket.close()


class SideChannel:
    """JSON POSTs to peers (Rules 1-3). One per server; not tied to a trio run until
    used."""

    def __init__(self, *, timeout: float = 5.0, max_body: int = 1 << 20) -> None:
        self.timeout = timeout
        self.max_body = max_body
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(
        self, host: str, port: int, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PeerAnswer:
        """POST ``body`` (JSON) to ``http://host:port/path`` with ``headers``; the answer,
        or :class:`PeerUnavailable` (Rule 1)."""
        with trio.move_on_after(self.timeout) as scope:
            return await self._post(host, port, path, body, headers)
        assert scope.cancelled_caught
        raise PeerUnavailable(f"{host}:{port} did not answer within {self.timeout:g} s")

    async def _post(
        self, host: str, port: int, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> PeerAnswer:
        key = (host, port)
        conn = self._take(key)
        if conn is None:
            try:
                conn = _Connection(await trio.open_tcp_stream(host, port))
            except OSError as exc:
                raise PeerUnavailable(
                    f"cannot connect to {host}:{port}: {_describe(exc)}"
                ) from None
        try:
            answer = await self._exchange(conn, host, port, path, body, headers)
        except _ERRORS as exc:
            conn.close()
            raise PeerUnavailable(f"{host}:{port}: {_describe(exc)}") from None
        except BaseException:
            conn.close()
            raise
        self._give_back(key, conn)
        return answer

    async def _exchange(
        self,
        conn: _Connection,
        host: str,
        port: int,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
    ) -> PeerAnswer:
        h = conn.h11
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        head = [
            ("host", authority),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            *headers,
        ]
        data = h.send(h11.Request(method="POST", target=path, headers=head)) or b""
        data += h.send(h11.Data(data=body)) or b""
        data += h.send(h11.EndOfMessage()) or b""
        await conn.stream.send_all(data)
        status = 0
        parts: list[bytes] = []
        size = 0
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(await conn.stream.receive_some(_RECEIVE))
            elif type(event) is h11.Response:
                status = event.status_code
            elif type(event) is h11.Data:
                size += len(event.data)
                if size > self.max_body:
                    raise h11.RemoteProtocolError(f"answer longer than {self.max_body} bytes")
                parts.append(bytes(event.data))
            elif type(event) is h11.EndOfMessage:
                return PeerAnswer(status, b"".join(parts))
            elif type(event) is h11.ConnectionClosed:
                raise h11.RemoteProtocolError("the peer closed the connection")

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.stream.socket.is_readable():  # closed by the peer (Rule 2)
                conn.close()
                continue
            return conn
        return None

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        h = conn.h11
        idle = self._idle.setdefault(key, [])
        if h.our_state is h11.DONE and h.their_state is h11.DONE and len(idle) < _MAX_IDLE:
            h.start_next_cycle()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection (Rule 3)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    for err in (cause, exc):
        if isinstance(err, OSError) and err.strerror:
            return err.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
