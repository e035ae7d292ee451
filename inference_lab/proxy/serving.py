"""The proxy's listening socket and its life under hypercorn's trio worker.

Rule 1: the proxy binds its socket itself (so ``--port 0`` names its port in the banner
        before anything is served) and hands it to hypercorn's trio worker through the
        server's transport interface (``serve/transport``: ``serve``).
Rule 2: SIGINT or SIGTERM stops accepting and gives live requests
        :data:`FLUSH_TIMEOUT` seconds before their connections are cut.
Rule 3: connections are served by the transport's hooked connection server
        (``install_connection_hook``), so a stream's pieces are written to the client as
        pre-framed chunks (``transport.chunk_writer``) rather than through h11 one by one.
"""

from __future__ import annotations

import signal
import socket
from typing import Any

import trio

from inference_lab.serve.transport import install_connection_hook, serve

__all__ = ["FLUSH_TIMEOUT", "bind", "serve_proxy", "serve_until_signalled"]

#: Seconds live requests get after a signal.
FLUSH_TIMEOUT = 2.0
#: Seconds an idle keep-alive connection is kept.
KEEP_ALIVE_TIMEOUT = 5.0
BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (Rule 1); raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_proxy(
    app: Any,
    sock: socket.socket,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sock`` (taken over) until ``stop`` is set (Rule 2)."""
    install_connection_hook()  # the transport's connection server: cheap mid-body writes
    await serve(
        app,
        sock,
        shutdown_trigger=stop.wait,
        flush_timeout=FLUSH_TIMEOUT,
        keep_alive_timeout=KEEP_ALIVE_TIMEOUT,
        backlog=BACKLOG,
        task_status=task_status,
    )


async def serve_until_signalled(app: Any, sock: socket.socket, banner: str) -> None:
    """Serve until SIGINT or SIGTERM; ``banner`` is printed once serving."""
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    stop.set()
                    return

            nursery.start_soon(watch)
            await nursery.start(serve_proxy, app, sock, stop)
            print(banner, flush=True)
            await stop.wait()
            nursery.cancel_scope.deadline = trio.current_time() + FLUSH_TIMEOUT + 1.0
