"""Noticing that a request's client has left, while its answer is produced.

Rule 1: where the transport offers a close watch (``transport.close_watch``) the client's
        departure is told synchronously by the connection, and :func:`while_watched` adds
        no task; elsewhere one task waits for the ``http.disconnect`` message.
Rule 2: ``on_gone`` is called at most once per watch, synchronously (it aborts requests
        and wakes writers; it must not await), also when the client had already left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from inference_lab.serve.exchange import Receive, Send
from inference_lab.serve.transport import close_watch

__all__ = ["while_watched"]


async def _until_disconnect(receive: Receive, on_gone: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return


async def while_watched(
    send: Send,
    receive: Receive,
    on_gone: Callable[[], None],
    work: Callable[[], Awaitable[None]],
) -> None:
    """Run ``work()`` while watching for the client of the request ``send`` answers to
    leave; ``on_gone`` is called when it does (Rules 1-2). Called by the completion,
    agent and embedding routes."""
    watch = close_watch(send)
    if watch is not None:
        if not watch.watch_close(on_gone):
            on_gone()  # it has already left
        try:
            await work()
        finally:
            watch.unwatch_close()
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_until_disconnect, receive, on_gone)
        try:
            await work()
        finally:
            nursery.cancel_scope.cancel()
