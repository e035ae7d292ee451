"""When the kernel received a socket's bytes: receive timestamps (``SO_TIMESTAMPNS``).

The server stamps a request's arrival, and the load client a token's, with the time the
kernel received the bytes rather than the time the process got round to reading them: on
a busy or idle machine the two differ by the process's wake-up, which is neither the
server's model nor the network.

Rule 1: a stamp is the trio time at which the kernel received the latest packet a read
        returned: its ``CLOCK_REALTIME`` stamp moved onto trio's clock by the age measured
        at the read. A stamp older than :data:`MAX_RECEIPT_AGE`, or more than a
        millisecond in the future (a clock step), is not believed: None.
Rule 2: a read through :func:`receive_stamped` raises what ``trio.SocketStream.receive_some``
        raises: a closed socket is ClosedResourceError, a broken connection
        BrokenResourceError.
"""

from __future__ import annotations

import errno
import platform
import socket
import struct
import sys
import time
from typing import Any

import trio

__all__ = [
    "MAX_RECEIPT_AGE",
    "SO_TIMESTAMPNS",
    "enable_receive_timestamps",
    "kernel_receipt",
    "receive_stamped",
    "receives_timestamps",
]

#: Seconds beyond which a receipt time is not believed (a clock step).
MAX_RECEIPT_AGE = 1.0

#: ``SO_TIMESTAMPNS`` (Python's socket module does not name it): the kernel then stamps
#: each received packet (``CLOCK_REALTIME``, a ``struct timespec``) and ``recvmsg`` hands
#: the stamp of the latest one read back as ancillary data of the same type. Its number is
#: 35 on Linux's generic socket ABI (x86, arm, riscv); elsewhere the option is not used.
_GENERIC_ABI = ("x86_64", "i386", "i686", "aarch64", "arm64", "armv7l", "riscv64")
SO_TIMESTAMPNS: int | None = getattr(
    socket,
    "SO_TIMESTAMPNS",
    35 if sys.platform == "linux" and platform.machine() in _GENERIC_ABI else None,
)
_TIMESPEC = struct.Struct("@ll")
_ANCILLARY_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)


def enable_receive_timestamps(sock: Any) -> bool:
    """Have the kernel stamp the packets ``sock`` receives (``SO_TIMESTAMPNS``). On a
    listening socket this is inherited by the connections it accepts, and it turns the
    kernel's stamping on before their first bytes arrive. False where the platform or the
    socket has no such option (nothing changed)."""
    if SO_TIMESTAMPNS is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except (AttributeError, OSError):
        return False
    return True


def receives_timestamps(sock: Any) -> bool:
    """Whether the kernel stamps the packets ``sock`` receives (see
    :func:`enable_receive_timestamps`); False where it cannot be asked."""
    if SO_TIMESTAMPNS is None:
        return False
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS))
    except (AttributeError, OSError):
        return False


def kernel_receipt(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """The trio time of the receive timestamp in ``recvmsg``'s ancillary data, or None
    (no stamp, or one not believed: Rule 1)."""
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
            age = time.time() - (float(seconds) + float(nanoseconds) * 1e-9)
            if -1e-3 < age < MAX_RECEIPT_AGE:
                return trio.current_time() - max(0.0, age)
    return None


async def receive_stamped(
    sock: trio.socket.SocketType, max_bytes: int | None
) -> tuple[bytes, float | None]:
    """``trio.SocketStream.receive_some`` on ``sock`` as a ``recvmsg`` that also reads the
    receive timestamp: the bytes and their stamp (None without one). Rule 2's errors; the
    caller is the socket's only reader."""
    if max_bytes is None:
        max_bytes = 65536
    if max_bytes < 1:
        raise ValueError("max_bytes must be >= 1")
    try:
        data, ancillary, _flags, _address = await sock.recvmsg(max_bytes, _ANCILLARY_SPACE)
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ENOTSOCK):
            raise trio.ClosedResourceError("this socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
    return data, kernel_receipt(ancillary) if ancillary else None
