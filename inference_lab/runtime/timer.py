"""Sub-millisecond sleeps for the pacer.

trio's timed waits end on whole milliseconds: its run loop waits in ``epoll_wait``, whose
timeout is rounded up to a whole millisecond, so a ``sleep_until`` can wake up to 1 ms
late. The pacer releases tokens at the end of simulated steps that last a millisecond or
two, so that rounding alone would be up to a step of lag. A Linux ``timerfd`` has no such rounding:
the kernel makes its descriptor readable at the deadline (hrtimer precision), and trio's
``wait_readable`` returns from the same ``epoll_wait`` as soon as it is.

Rule 1: :class:`Timer` sleeps on a timerfd only where one exists (Linux) and only under
        trio's real clock: under a :class:`trio.testing.MockClock` (tests) or any other
        clock it falls back to ``trio.sleep_until``, so virtual time stays exact.
Rule 2: a sleep never ends before its deadline (the kernel timer is armed with the time
        left, rounded up to a whole nanosecond, on CLOCK_MONOTONIC, the clock behind
        ``time.perf_counter`` and therefore behind trio's real clock).
Rule 3: the descriptor belongs to one Timer and is closed by :meth:`Timer.close`; a Timer is
        used by one task at a time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
from collections.abc import Callable

import trio

__all__ = ["Timer", "timerfd_available"]

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _ctypes_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """(create, arm) through libc, for Pythons before 3.13 (``os.timerfd_*``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        create_fn = libc.timerfd_create
        settime_fn = libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create_fn.argtypes = [ctypes.c_int, ctypes.c_int]
    create_fn.restype = ctypes.c_int
    settime_fn.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Itimerspec),
        ctypes.POINTER(_Itimerspec),
    ]
    settime_fn.restype = ctypes.c_int

    def create() -> int:
        fd = int(create_fn(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return fd

    spec = _Itimerspec()  # reused: the pacer arms its timer once per engine step
    value = spec.it_value
    ref = ctypes.byref(spec)

    def arm(fd: int, ns: int) -> None:
        value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if settime_fn(fd, 0, ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return create, arm


def _os_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    create_os = getattr(os, "timerfd_create", None)
    settime_ns = getattr(os, "timerfd_settime_ns", None)
    if create_os is None or settime_ns is None:
        return None
    flags = os.TFD_NONBLOCK | os.TFD_CLOEXEC  # type: ignore[attr-defined,unused-ignore]

    def create() -> int:
        return int(create_os(_CLOCK_MONOTONIC, flags=flags))

    def arm(fd: int, ns: int) -> None:
        settime_ns(fd, initial=ns)

    return create, arm


_TIMERFD = _os_timerfd() or _ctypes_timerfd()


def timerfd_available() -> bool:
    """Whether this platform offers a timerfd (Linux)."""
    return _TIMERFD is not None


def _real_clock() -> bool:
    clock = trio.lowlevel.current_clock()
    return type(clock).__name__ == "SystemClock" and type(clock).__module__.startswith("trio.")


class Timer:
    """A one-task sleeper: ``await timer.sleep_until(deadline)`` (trio time).

    Created and closed by the pacer task (:class:`inference_lab.runtime.model_runtime.ModelRuntime`).
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self.precise = False
        if _TIMERFD is not None and _real_clock():
            try:
                self._fd = _TIMERFD[0]()
            except OSError:
                self._fd = None
            self.precise = self._fd is not None

    async def sleep_until(self, deadline: float) -> None:
        """Return at ``deadline`` (never before); a checkpoint even when it has passed."""
        fd = self._fd
        if fd is None:
            await trio.sleep_until(deadline)
            return
        assert _TIMERFD is not None
        left = deadline - trio.current_time()
        if left <= 0:
            await trio.lowlevel.checkpoint()
            return
        _TIMERFD[1](fd, max(1, math.ceil(left * 1e9)))
        try:
            await trio.lowlevel.wait_readable(fd)
        except BaseException:
            _TIMERFD[1](fd, 0)  # disarm: a cancelled sleep leaves no expiry behind
            raise
        try:
            os.read(fd, 8)
        except BlockingIOError:  # pragma: no cover - readable means one expiry is there
            pass

    def close(self) -> None:
        """Release the descriptor (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
