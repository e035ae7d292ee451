"""What the harness's answers send: ASGI body messages, a stream that ends when its
client leaves, and the connection reset.

Rule 1: :func:`serve_stream` starts a 200 event stream and runs its writer until the
        writer returns or the client leaves; a writer that returns without the last body
        message ends the stream abruptly (the server closes without the chunked
        terminator).
Rule 2: :func:`reset_connection` arms ``SO_LINGER`` 0 on the connection's socket and closes
        it (a TCP RST) when the transport has one for the request
        (``transport.connection_socket``: ``inference-lab serve`` and a plain hypercorn
        launch); elsewhere (an in-memory test client) the caller's plain close is all
        there is.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Awaitable, Callable

import trio

from inference_lab.serve.error_replies import STREAM_HEADERS
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.transport import connection_socket

__all__ = [
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


async def reset_connection(send: Send) -> bool:
    """Close the connection of the request ``send`` answers with a TCP RST (``SO_LINGER``
    0, then a close through trio, which wakes the server's reader). False when the
    transport has no socket for it (then the caller's plain close is all there is)."""
    stream = connection_socket(send)
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
