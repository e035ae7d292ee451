"""``GET /health``: one answer, whoever gives it.

Rule 1: :func:`health_reply` is the answer: 200 ``{"status":"ok"}`` while every model's
        engine runs, else 503 naming each model's state with ``Retry-After``. It reads
        only the runtimes' published snapshots (no work, no await).
Rule 2: the connection answers it itself, where the request's bytes are read, before the
        queue of work (:meth:`quick_answer`, through ``transport.quick``); the Quart route
        answers it everywhere else (the in-memory test client, a request the quick path
        leaves, another ASGI server). Both pass the gate first (request id, CORS, the 503
        of a shutdown), so both give the same answer.

Who calls this: ``serve/routes.py`` (the route) and ``serve/asgi.py`` (the app's
``quick_answer``).
"""

from __future__ import annotations

import attrs
import trio

from inference_lab.serve import gate
from inference_lab.serve.error_replies import (
    RETRY_AFTER_UNAVAILABLE,
    Reply,
    json_reply,
    retry_after_header,
)
from inference_lab.serve.exchange import Exchange
from inference_lab.serve.state import ServeState
from inference_lab.serve.transport import QuickReply

__all__ = ["HEALTH_PATH", "health_reply", "quick_answer"]

HEALTH_PATH = "/health"
_OK = Reply(200, b'{"status":"ok"}')


def health_reply(state: ServeState) -> Reply:
    """Rule 1: the answer to ``GET /health`` (and ``/ping``) now."""
    alive = {name: rt.snapshot().alive for name, rt in state.runtimes.items()}
    if all(alive.values()):
        return _OK
    models = {name: ("running" if up else "stopped") for name, up in alive.items()}
    reply = json_reply({"status": "unavailable", "models": models}, 503)
    return attrs.evolve(reply, headers=(retry_after_header(RETRY_AFTER_UNAVAILABLE),))


def quick_answer(
    state: ServeState,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
) -> QuickReply | None:
    """Rule 2: the whole answer to a request the connection offers (``GET`` of a quick
    path), gated as the app's ASGI connection gates every request; None for any other."""
    if method != "GET" or path != HEALTH_PATH:
        return None
    exchange = Exchange.read_whole(method, path, headers, client, trio.current_time())
    return gate.quick_reply(state, exchange, lambda: health_reply(state))
