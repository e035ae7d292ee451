"""A request body, read from the ASGI messages under the completion routes' bounds.

:func:`read_body` is how every route served on raw ASGI messages (the completion routes,
the agent routes) reads its body; :func:`body_refusal` is the answer to a body it refuses.

Rule 1: a body is refused as soon as its declared or received length passes the limit
        (413), or once it has come in more than :data:`MAX_BODY_PIECES` pieces (413); a
        client that leaves first ends the read (:class:`ClientGone`).
Rule 2: only a wait for a piece is bounded by the body's deadline (408): a body that came
        with its headers (the usual case) costs no cancel scope, and a piece the server
        already holds is taken without a trip through the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio

from inference_lab.api.requests import MAX_BODY_BYTES
from inference_lab.serve.error_replies import (
    Reply,
    body_timeout_reply,
    body_too_fragmented_reply,
    body_too_large_reply,
)
from inference_lab.serve.exchange import Receive

__all__ = [
    "MAX_BODY_PIECES",
    "BodyRefused",
    "BodyTimeout",
    "BodyTooFragmented",
    "BodyTooLarge",
    "ClientGone",
    "body_refusal",
    "read_body",
]

#: A body may arrive in at most this many pieces (ASGI messages). Each piece costs the
#: stack tens of microseconds of CPU, so a 2 MiB body in 4-byte chunks (half a million
#: pieces) would hold the server for seconds; this bound refuses it long before. A real
#: client's body comes in a few pieces (hypercorn reads 64 KiB at a time; 2 MiB in
#: 1,460-byte TCP segments is 1,437).
MAX_BODY_PIECES = 16_384


class BodyRefused(Exception):
    """A request body the server does not take (raised by :func:`read_body`): answered
    with :func:`body_refusal`."""


class BodyTooLarge(BodyRefused):
    """The request body passed :data:`MAX_BODY_BYTES` (raised by :func:`read_body`)."""


class BodyTooFragmented(BodyRefused):
    """The request body arrived in more than :data:`MAX_BODY_PIECES` pieces (raised by
    :func:`read_body`)."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyTimeout(BodyRefused):
    """The request body was not complete by its deadline (raised by :func:`read_body`)."""


def body_refusal(refused: BodyRefused, timeout: float) -> Reply:
    """The answer to a refused body: 413 (too large), 413 (too many pieces) or 408 (not
    whole within ``timeout`` seconds)."""
    if isinstance(refused, BodyTooLarge):
        return body_too_large_reply()
    if isinstance(refused, BodyTooFragmented):
        return body_too_fragmented_reply(MAX_BODY_PIECES)
    return body_timeout_reply(timeout)


def _declared_length(scope: dict[str, Any], limit: int) -> int | None:
    """The body length the request's ``content-length`` declares (None: none, or not a
    number); raises :class:`BodyTooLarge` when it passes ``limit``."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return None
            if declared > limit:
                raise BodyTooLarge
            return declared
    return None


def _receive_nowait(receive: Receive) -> Callable[[], dict[str, Any]] | None:
    """``receive_nowait`` of the memory channel whose ``receive`` hypercorn hands the app
    (its per-request queue of body pieces), or None for any other ``receive``."""
    channel = getattr(receive, "__self__", None)
    if isinstance(channel, trio.MemoryReceiveChannel) and (
        getattr(receive, "__func__", None) is trio.MemoryReceiveChannel.receive
    ):
        take: Callable[[], dict[str, Any]] = channel.receive_nowait
        return take
    return None


async def read_body(
    receive: Receive,
    scope: dict[str, Any],
    limit: int = MAX_BODY_BYTES,
    deadline: float = math.inf,
) -> bytes:
    """The whole request body. Raises :class:`BodyTooLarge` as soon as the declared or
    received length passes ``limit`` and :class:`BodyTooFragmented` as soon as it has
    come in more than :data:`MAX_BODY_PIECES` pieces (nothing more is read),
    :class:`ClientGone` when the client disconnects first and :class:`BodyTimeout` when
    it is still waiting for a piece at the trio time ``deadline``.

    A piece the server already holds is taken without a trip through the scheduler
    (hypercorn's channel, :func:`_receive_nowait`): under load each such trip waits for
    every other runnable task, and a body that came with its headers (the usual case)
    would otherwise pay one before admission. A body whose declared length has arrived
    is whole: hypercorn's separate end-of-body message, which its reading task queues
    only after a trip through the scheduler, is not waited for. Only a wait for a piece
    is bounded by the deadline (a cancel scope, which costs CPU of its own): a body at
    hand needs none."""
    declared = _declared_length(scope, limit)
    receive_nowait = _receive_nowait(receive)
    chunks: list[bytes] = []
    size = 0
    pieces = 0
    while True:
        pieces += 1
        if pieces > MAX_BODY_PIECES:
            raise BodyTooFragmented
        message = None
        if receive_nowait is not None:
            try:
                message = receive_nowait()
            except trio.WouldBlock:
                pass
        if message is None:
            if deadline == math.inf:
                message = await receive()
            else:
                with trio.move_on_at(deadline):
                    message = await receive()
                if message is None:
                    raise BodyTimeout
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise BodyTooLarge
            chunks.append(body)
        if not message.get("more_body", False) or (declared is not None and size >= declared):
            break  # (hypercorn's end-of-body message after the declared length is not awaited)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
