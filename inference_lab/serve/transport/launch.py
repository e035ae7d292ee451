"""Running the app under hypercorn's trio worker on a socket the server bound itself.

Rule 1: hypercorn adopts the socket by file descriptor and owns (and closes) it from
        then on; it calls ``listen`` on it again, with the backlog given here.
Rule 2: the connections accepted inherit the listener's arrival stamps
        (:func:`~inference_lab.serve.transport.connection.enable_receive_timestamps`,
        asked by the caller before it listens), so their first bytes are stamped too.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["serve"]


def _config(
    sock: socket.socket, flush_timeout: float, keep_alive_timeout: float, backlog: int
) -> Config:
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.backlog = backlog
    config.graceful_timeout = flush_timeout
    config.keep_alive_timeout = keep_alive_timeout
    config.accesslog = None
    config.loglevel = "WARNING"
    return config


async def serve(
    app: Any,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    flush_timeout: float,
    keep_alive_timeout: float,
    backlog: int,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the bound ``sock`` (taken over) until ``shutdown_trigger`` returns;
    then hypercorn stops accepting and gives live connections ``flush_timeout`` seconds
    before it cancels them. ``task_status.started`` gets hypercorn's bound URLs."""
    config = _config(sock, flush_timeout, keep_alive_timeout, backlog)
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
