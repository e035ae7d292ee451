"""The keep-alive idle timer of one connection (``connection.py``'s Rule 3).

:class:`IdleTimer` takes the place of hypercorn's ``TrioSingleTask`` as a connection
server's ``idle_task``: one watcher task per connection, whose deadline the start and end
of each request move.
"""

from __future__ import annotations

import math
from typing import Any

import trio
from hypercorn.events import RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

from inference_lab.errors import error_body

__all__ = ["IdleTimer"]


class IdleTimer:
    """The keep-alive idle timer of one connection (Rule 3), in place of hypercorn's
    ``TrioSingleTask``: the same ``restart`` (the connection became idle) and ``stop`` (a
    request began), but one watcher task per connection whose deadline they move.

    While idle, the watcher closes the connection as hypercorn's own idle task does
    (``_initiate_server_close``) once ``keep_alive_timeout`` has passed or the server
    terminates; while a request runs it only waits. :meth:`finish` ends it when the
    connection's reading has ended (the connection then closes through hypercorn's own
    teardown)."""

    __slots__ = (
        "_server",
        "_idle",
        "_deadline",
        "_finished",
        "_started",
        "_scope",
        "_lot",
        "_reads_at_idle",
    )

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._idle = False
        self._deadline = math.inf
        self._finished = False
        self._started = False
        self._scope: trio.CancelScope | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._reads_at_idle = 0

    async def restart(self, task_group: Any, action: Any) -> None:
        """The connection is idle from now: close it after ``keep_alive_timeout``
        (``action``, hypercorn's own idle task, is not used)."""
        self._idle = True
        self._deadline = trio.current_time() + self._server.config.keep_alive_timeout
        self._reads_at_idle = self._server._receipt.reads  # type: ignore[attr-defined]
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._watch)
        else:
            self._lot.unpark_all()  # a watcher waiting out a request now waits on idleness
            if self._scope is not None:
                self._scope.deadline = self._deadline

    async def stop(self) -> None:
        """A request began: the connection is not idle. Once ``keep_alive_timeout`` has
        passed the watcher looks whether an HTTP/2 connection has a stream in progress
        (an HTTP/1.1 request always has: hypercorn says when it ends)."""
        self._idle = False
        self._deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is not None:
            self._scope.deadline = self._deadline
        else:
            self._lot.unpark_all()

    def finish(self) -> None:
        """The connection's reading has ended: end the watcher without closing."""
        self._finished = True
        if self._scope is not None:
            self._scope.cancel()
        self._lot.unpark_all()

    def _h2_without_streams(self) -> bool:
        """Whether the connection speaks HTTP/2 and no stream is in progress on it."""
        protocol = getattr(getattr(self._server, "protocol", None), "protocol", None)
        return isinstance(protocol, H2Protocol) and protocol.idle

    def _partial_head(self) -> bool:
        """Whether an idle HTTP/1.1 connection received bytes that no request began with
        (a request head that did not arrive whole)."""
        protocol = getattr(getattr(self._server, "protocol", None), "protocol", None)
        receipt = self._server._receipt  # type: ignore[attr-defined]
        return isinstance(protocol, H11Protocol) and receipt.reads > self._reads_at_idle

    async def _watch(self) -> None:
        terminated = self._server.context.terminated
        while not self._finished:
            with trio.CancelScope(deadline=self._deadline) as scope:
                self._scope = scope
                if self._idle:
                    await terminated.wait()
                else:
                    await self._lot.park()  # until the deadline or the next change
            self._scope = None
            if self._finished:
                return
            now = trio.current_time()
            if self._idle and (terminated.is_set() or now >= self._deadline):
                with trio.CancelScope(shield=True):
                    if self._partial_head() and not terminated.is_set():
                        await self._server._write(  # type: ignore[attr-defined]
                            RawData(data=_HEAD_TIMEOUT), shielded=True
                        )
                    await self._server._initiate_server_close()
                return
            if not self._idle and now >= self._deadline:
                if self._h2_without_streams():
                    with trio.CancelScope(shield=True):
                        await self._server._initiate_server_close()
                    return
                self._deadline = now + self._server.config.keep_alive_timeout


def _head_timeout_reply() -> bytes:
    body = error_body(
        "The request head did not arrive in time: the connection is closed",
        "invalid_request_error",
        "request_timeout",
        None,
    )
    return (
        b"HTTP/1.1 408 \r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    ) + body


#: What a connection whose request head did not arrive whole in time is told (Rule 3).
_HEAD_TIMEOUT = _head_timeout_reply()
