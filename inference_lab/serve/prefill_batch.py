"""A batch of prefill-only engine requests answered with one JSON body: how
``/v1/embeddings`` and the pooling routes (``serve/pooling_routes.py``) are served.

Rule 1: each item is one engine request of its prompt tokens with ``max_tokens`` 1 (one
        prefill pass, no drawn length), all admitted in one synchronous pass or none: when
        one is refused, those admitted before it are withdrawn (``RequestHandle.withdraw``)
        and the request is a 529 / 503. An item longer than the model's context is a 400
        naming it, before any is admitted. The items queue, batch and count toward
        ``max_waiting`` like any other request.
Rule 2: the answer is sent once every item finished, in pieces (with a checkpoint
        between) in messages of about :data:`SEND_CHUNK` bytes, so a large batch never
        holds up the event loop; a client that leaves aborts every item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import trio

from inference_lab.errors import ApiError, EngineUnavailable, QueueFull
from inference_lab.runtime.model_runtime import ModelRuntime, RequestHandle
from inference_lab.serve.client_gone import while_watched
from inference_lab.serve.error_replies import (
    JSON,
    Reply,
    engine_failed_reply,
    error_reply,
    send_reply,
    shutting_down_reply,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.state import ServeState
from inference_lab.serve.streaming import CollectSink

__all__ = ["SEND_CHUNK", "refuse", "send_pieces", "serve_prefill_batch"]

#: A body is sent in messages of about this many bytes (a small one whole, in one write).
SEND_CHUNK = 256 * 1024


class _Batch:
    """The sinks of one request's items: done when all finished, or when one failed or
    the client left."""

    def __init__(self, count: int) -> None:
        self.sinks = [CollectSink() for _ in range(count)]
        self.handles: list[RequestHandle] = []

    def gone(self) -> None:
        for handle in self.handles:
            handle.close()
        for sink in self.sinks:
            sink.on_gone()

    async def wait(self) -> None:
        for sink in self.sinks:
            await sink.event.wait()
            if sink.finished is None:
                return

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


async def refuse(state: ServeState, exchange: Exchange, send: Send, exc: Exception) -> None:
    """An :class:`ApiError`, ``QueueFull`` or ``EngineUnavailable`` as its whole reply."""
    reply = error_reply(exc, should_retry_header=state.settings.should_retry_header)
    await send_reply(send, reply, exchange.headers)


def _admit(
    runtime: ModelRuntime, batch: _Batch, tokens: Sequence[int], priority: int, arrival: float
) -> None:
    """Every item admitted, or none (Rule 1)."""
    try:
        for count, sink in zip(tokens, batch.sinks, strict=True):
            handle = runtime.admit_nowait(
                prompt_tokens=max(1, count),
                max_tokens=1,
                priority=priority,
                sink=sink,
                arrival=arrival,
                limit=1,
                drawn=False,
            )
            batch.handles.append(handle)
    except (QueueFull, EngineUnavailable):
        for handle in batch.handles:
            handle.withdraw()
        batch.handles.clear()
        raise


async def serve_prefill_batch(
    state: ServeState,
    exchange: Exchange,
    receive: Receive,
    send: Send,
    *,
    runtime: ModelRuntime,
    tokens: Sequence[int],
    priority: int,
    where: Callable[[int], str],
    pieces: Callable[[], Iterator[bytes]],
) -> None:
    """Admit one prefill-only request per item of ``tokens`` (Rule 1), wait for all and
    send ``pieces()`` (Rule 2); every refusal is sent here. ``where(i)`` names item
    ``i``'s field in a 400."""
    batch: _Batch | None = None
    try:
        for i, count in enumerate(tokens):
            refused = runtime.check_fits(max(1, count), 1)
            if refused is not None:
                raise ApiError(400, "context_length_exceeded", refused.reason, where(i))
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        batch = _Batch(len(tokens))
        _admit(runtime, batch, tokens, priority, exchange.arrival)
    except (ApiError, QueueFull, EngineUnavailable) as exc:
        await refuse(state, exchange, send, exc)
        return
    try:
        await while_watched(send, receive, batch.gone, batch.wait)
        batch.close()
        failed = next((s for s in batch.sinks if s.finished is None), None)
        if failed is not None:
            if failed.gone:
                return
            if state.shutdown_message is not None:
                reply = shutting_down_reply(state.shutdown_message)
            else:
                reply = engine_failed_reply(failed.failure or "The engine failed.")
            with trio.CancelScope(shield=True):
                await send_reply(send, reply, exchange.headers)
            return
        await send_pieces(send, exchange, pieces())
    finally:
        batch.close()


async def send_pieces(send: Send, exchange: Exchange, pieces: Iterator[bytes]) -> None:
    """A 200 JSON body built piece by piece with a checkpoint after each (Rule 2), sent in
    messages of about :data:`SEND_CHUNK` bytes; a body smaller than that is one reply."""
    buffer: list[bytes] = []
    size = 0
    started = False
    for piece in pieces:
        buffer.append(piece)
        size += len(piece)
        if size >= SEND_CHUNK:
            if not started:
                headers = [(b"content-type", JSON), *exchange.headers]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
            await send({"type": "http.response.body", "body": b"".join(buffer), "more_body": True})
            buffer, size = [], 0
        await trio.lowlevel.checkpoint()
    with trio.CancelScope(shield=True):
        if not started:
            await send_reply(send, Reply(200, b"".join(buffer)), exchange.headers)
        else:
            await send({"type": "http.response.body", "body": b"".join(buffer), "more_body": False})
