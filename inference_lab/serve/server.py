"""The server's lifecycle: the listening socket, hypercorn's trio worker, signals.

Rule 1: the server binds the listening socket itself, so it can set ``TCP_USER_TIMEOUT``:
        a client that stops reading can then pin neither a connection nor a graceful
        shutdown for longer than that (hypercorn shields its socket writes).
Rule 2: SIGINT / SIGTERM start a graceful shutdown (``ServeState.drain``): new requests
        get 503 with ``Connection: close``, live ones get the grace period, then each still
        live ends with an answer naming the shutdown (a stream: its error frame, ``[DONE]``
        and a complete chunked body) before hypercorn is told to stop. A second signal ends
        the grace period at once; a third stops without waiting. No traceback.
Rule 3: the backlog asked for is the one in force: :func:`bind_socket` listens with it
        and hypercorn, which calls ``listen`` again on the socket it adopts, is given the
        same value.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from inference_lab.serve import transport
from inference_lab.serve.asgi import get_state

__all__ = [
    "DEFAULT_BACKLOG",
    "FLUSH_TIMEOUT",
    "GRACEFUL_TIMEOUT",
    "KEEP_ALIVE_TIMEOUT",
    "bind_socket",
    "raise_fd_limit",
    "serve_app",
    "serve_until_signalled",
    "somaxconn",
]

#: Seconds in-flight requests get to finish after SIGINT / SIGTERM (``--shutdown-grace``).
GRACEFUL_TIMEOUT = 3.0
#: Seconds the last frames of requests ended by a shutdown get to reach their clients
#: before hypercorn cancels the connections (hypercorn's own ``graceful_timeout``).
FLUSH_TIMEOUT = 2.0
#: The listen backlog (``--backlog``); hypercorn's own default is 100.
DEFAULT_BACKLOG = 2048
#: Milliseconds sent data may stay unacknowledged (or unsent behind a zero window) before
#: the kernel drops the connection. Accepted sockets inherit it from the listener.
TCP_USER_TIMEOUT_MS = 10_000
#: Seconds an idle keep-alive connection is kept.
KEEP_ALIVE_TIMEOUT = 5.0


def bind_socket(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A TCP socket on ``host:port`` listening with ``backlog``, with ``TCP_USER_TIMEOUT``
    set and the kernel stamping what it receives (both inherited by accepted connections on
    Linux). Raises OSError. Serve it with the
    same ``backlog`` (:func:`serve_app`), which hypercorn applies again (Rule 3)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
        transport.enable_receive_timestamps(sock)  # arrivals stamped by the kernel
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def somaxconn() -> int | None:
    """The kernel's cap on listen backlogs (Linux), or None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return None


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit: every connection
    is a file descriptor, and a 1,000-connection burst passes the common soft limit of
    1024 (trio's accept loop would then stall until descriptors are freed)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve_app(
    app: Any,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = GRACEFUL_TIMEOUT,
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
    backlog: int = DEFAULT_BACKLOG,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (made by ``create_app``) with hypercorn's trio worker on an
    already-bound ``sock`` (which it takes over, listening with ``backlog``) until
    ``shutdown_trigger`` returns; then the app drains (Rule 2: new requests 503, live ones
    get ``graceful_timeout`` seconds, then end with an answer naming the shutdown) and
    only then is hypercorn told to stop, giving the last frames :data:`FLUSH_TIMEOUT`
    seconds. ``task_status.started`` gets hypercorn's bound URLs. Tests use it with
    ``await nursery.start(serve_app, app, bind_socket("127.0.0.1", 0))``.
    """
    trigger = shutdown_trigger
    if shutdown_trigger is not None:
        state = get_state(app)

        async def drain_then_stop() -> None:
            await shutdown_trigger()
            # hypercorn cancels every connection FLUSH_TIMEOUT s after this returns: the
            # runtimes stop first, so no stream is cut mid-message.
            await state.drain(graceful_timeout)

        trigger = drain_then_stop
    await transport.serve(
        app,
        sock,
        shutdown_trigger=trigger,
        flush_timeout=FLUSH_TIMEOUT,
        keep_alive_timeout=keep_alive_timeout,
        backlog=backlog,
        task_status=task_status,
    )


async def serve_until_signalled(
    app: Any, sock: socket.socket, *, grace: float, backlog: int, banner: str, prog: str
) -> None:
    """Serve until signalled (the first signal drains, the second hurries live requests,
    the third stops at once). ``banner`` is printed once hypercorn serves -- after the
    app's start-up and warm-up -- so a client that waits for it is answered at once: one
    that connected earlier waited in the kernel's accept queue, and the kernel's receive
    time, the request's arrival stamp, counted that wait in its latency."""
    stop = trio.Event()
    state = get_state(app)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                signalled = 0
                async for signum in signals:
                    signalled += 1
                    if signalled == 1:
                        name = signal.Signals(signum).name
                        print(
                            f"{prog}: {name}: shutting down (new requests get 503; live "
                            f"requests get {grace:g} s)",
                            file=sys.stderr,
                        )
                        stop.set()
                    elif signalled == 2:
                        print(f"{prog}: second signal: ending live requests now", file=sys.stderr)
                        state.hurry()
                    else:
                        print(f"{prog}: third signal: stopping now", file=sys.stderr)
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)

            async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve_app(
                    app,
                    sock,
                    shutdown_trigger=stop.wait,
                    graceful_timeout=grace,
                    backlog=backlog,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()

            await nursery.start(serve)
            print(banner, flush=True)
