"""What the harness's answers send: ASGI body messages, a stream that ends when its
client leaves, and the connection reset.

Rule 1: :func:`serve_stream` starts a 200 event stream and runs its writer until the
        writer returns or the client leaves; a writer that returns without the last body
        message ends the stream abruptly (the server closes without the chunked
        terminator).
Rule 2: :func:`reset_connection` arms ``SO_LINGER`` 0 on the connection's socket and closes
        it (a TCP RST) when :func:`connection_stream` finds it (hypercorn's trio worker:
        ``inference-lab serve`` and a plain hypercorn launch); elsewhere (an in-memory
        test client) the caller's plain close is all there is.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.responses import STREAM_HEADERS

__all__ = [
    "connection_stream",
    "reset_connection",
    "send_last",
    "send_more",
    "serve_stream",
]

logger = logging.getLogger("inference_lab.serve")


async def send_more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def send_last(send: Send, data: bytes) -> None:
    with trio.CancelScope(shield=True):
        await send({"type": "http.response.body", "body": data, "more_body": False})


def _socket_stream(value: Any) -> trio.SocketStream | None:
    if isinstance(value, trio.SocketStream):
        return value
    if isinstance(value, trio.SSLStream) and isinstance(value.transport_stream, trio.SocketStream):
        return value.transport_stream
    return None


def _peer(stream: trio.SocketStream) -> tuple[str, int] | None:
    try:
        name = stream.socket.getpeername()
    except OSError:
        return None
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) else None


def connection_stream(scope: Mapping[str, Any]) -> trio.SocketStream | None:
    """The trio stream of the TCP connection the current task's request came on, or None.

    hypercorn's trio worker serves each connection in a task started by
    ``trio.serve_listeners``, whose coroutine holds the accepted stream (the same object
    as hypercorn's ``TCPServer.stream``), and runs the ASGI app in a task below it. So
    this walks from the current task up the task tree and looks at the local variables of
    each task's coroutine chain for a socket stream whose peer is ``scope["client"]``.
    """
    client = scope.get("client")
    if not client:
        return None
    want = (str(client[0]), int(client[1]))
    task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
    while task is not None:
        coro: Any = task.coro
        for _ in range(64):  # the coroutine chain (cr_await), bounded
            frame = getattr(coro, "cr_frame", None)
            if frame is not None:
                for value in list(frame.f_locals.values()):
                    stream = _socket_stream(value)
                    if stream is not None and _peer(stream) == want:
                        return stream
            coro = getattr(coro, "cr_await", None)
            if coro is None:
                break
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return None


async def reset_connection(scope: Mapping[str, Any]) -> bool:
    """Close the request's connection with a TCP RST (``SO_LINGER`` 0, then a close
    through trio, which wakes the server's reader). False when the socket was not found
    (then the caller's plain close is all there is)."""
    stream = connection_stream(scope)
    if stream is None:
        logger.warning("reset fault: the connection's socket was not found; closing with FIN")
        return False
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        return False  # the client is gone already
    with trio.CancelScope(shield=True):
        await stream.aclose()
    return True


async def _until_gone(
    receive: Receive, scope: trio.CancelScope, on_gone: Callable[[], None]
) -> None:
    """Wait for the client to leave; then call ``on_gone`` and cancel the writer."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            scope.cancel()
            return


async def serve_stream(
    exchange: Exchange,
    receive: Receive,
    send: Send,
    write: Callable[[], Awaitable[None]],
    on_gone: Callable[[], None] = lambda: None,
) -> None:
    """Start a 200 event stream and run ``write`` until it returns or the client leaves.
    ``write`` ends the body itself, or returns without ending it (an abrupt ending)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_until_gone, receive, nursery.cancel_scope, on_gone)
        try:
            headers = [*STREAM_HEADERS, *exchange.headers]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await write()
        finally:
            nursery.cancel_scope.cancel()
