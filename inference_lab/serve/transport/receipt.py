"""A connection's stream, noting when the server had each read's bytes and when its
reading ended: ``connection.py``'s Rules 1 (the receive stamp), 4 (the write without a
scheduling point) and 6 (the close watch) as they apply to the stream itself.

:class:`ReceiptStream` wraps the trio stream hypercorn accepted; the hooked connection
server (:class:`~inference_lab.serve.transport.connection.LabTCPServer`) reads and writes
through it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import struct
import termios
from collections.abc import Callable
from typing import Any

import trio

from inference_lab.socket_stamps import enable_receive_timestamps, receive_stamped

__all__ = ["ReceiptStream"]

logger = logging.getLogger("inference_lab.serve")


class ReceiptStream:
    """A connection's trio stream that notes when the server had each read's bytes, and
    tells when the connection's reading has ended.

    ``received`` is the trio time at which the kernel received the bytes the latest
    ``receive_some`` returned, when the connection is a plain socket stream whose socket
    stamps what it receives (:func:`enable_receive_timestamps`, asked here and inherited
    from a listening socket that asked; the read is then a ``recvmsg``). Otherwise it is
    when that read returned (or, for the end of the stream, when it was seen) -- except
    for a connection's first read when its bytes were already waiting in the kernel when
    the server took the connection up (:meth:`note_waiting`): then it is that moment,
    before the server's own set-up of the connection.

    The reading has ended once a read returned the end of the stream or raised (Rule 6):
    then ``on_end`` (the connection server's) and the callback of :meth:`watch_close`
    (a request's) are called, once each, synchronously. Everything else is the wrapped
    stream's.
    """

    __slots__ = (
        "_stream",
        "received",
        "_waiting_since",
        "stamped",
        "plain",
        "reading",
        "reads",
        "_on_end",
        "_on_close",
    )

    def __init__(self, stream: Any, on_end: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self.received = -math.inf
        self._waiting_since: float | None = None
        #: Whether the stream is a plain trio socket stream (its socket is ``socket``).
        self.plain = type(stream) is trio.SocketStream
        #: Whether its socket stamps what it receives.
        self.stamped = self.plain and enable_receive_timestamps(stream.socket)
        #: False once the reading has ended.
        self.reading = True
        #: Reads that returned bytes (the idle timer tells a partial request head by it).
        self.reads = 0
        self._on_end = on_end
        self._on_close: Callable[[], None] | None = None

    @property
    def wrapped(self) -> Any:
        """The stream this one reads and writes through (hypercorn's accepted stream)."""
        return self._stream

    def note_waiting(self) -> None:
        """If bytes are waiting on the connection now, the first read's bytes were there
        at this moment (one ``FIONREAD``; nothing is noted when it cannot be asked)."""
        try:
            fd = self._stream.socket.fileno()
            waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):
            return
        if waiting > 0:
            self._waiting_since = trio.current_time()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        stamp: float | None = None
        try:
            if self.stamped:
                data, stamp = await receive_stamped(self._stream.socket, max_bytes)
            else:
                data = await self._stream.receive_some(max_bytes)
        except BaseException:
            self._end()
            raise
        since, self._waiting_since = self._waiting_since, None
        if stamp is None:
            stamp = trio.current_time() if since is None else since
        self.received = stamp
        if not data:
            self._end()
        else:
            self.reads += 1
        return data

    def watch_close(self, callback: Callable[[], None]) -> bool:
        """Have ``callback`` called once, synchronously, when this connection's reading
        ends -- the client closed or reset it, or the server closed it -- which is when
        hypercorn tells the request's app ``http.disconnect`` (Rule 6). One callback at a
        time (HTTP/1.1 serves one request at a time); :meth:`unwatch_close` removes it.
        False, and nothing registered, when the reading has already ended."""
        if not self.reading:
            return False
        self._on_close = callback
        return True

    def unwatch_close(self) -> None:
        self._on_close = None

    def _end(self) -> None:
        if not self.reading:
            return
        self.reading = False
        for callback in (self._on_end, self._on_close):
            if callback is None:
                continue
            try:
                callback()
            except Exception:  # noqa: BLE001 - the connection's teardown goes on
                logger.exception("a connection's close callback failed")
        self._on_end = self._on_close = None

    def send_nowait(self, data: bytes) -> int:
        """Write what the socket takes of ``data`` now, without a scheduling point: the
        number of bytes written (0 when its buffer is full, or when the stream is not a
        plain socket stream and the caller must use ``send_all``). A closed socket raises
        ClosedResourceError, a broken connection BrokenResourceError, as ``send_all``
        does. The caller must hold off any other writer (hypercorn's send lock)."""
        if not self.plain:
            return 0
        fd = self._stream.socket.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("this socket was already closed")
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.ENOTSOCK):
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
