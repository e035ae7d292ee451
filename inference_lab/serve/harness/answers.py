"""The answers the harness gives instead of the normal completion path: fault-injected
streams and scripted answers.

Rule 1: a fault or scripted answer that bypasses the engine never touches a runtime: no
        fit check, no depth check (never a 529).
Rule 2: a paced fault is admitted like any request (400 fit, 503, 529); its engine
        request is aborted when the ending applies, and its handle is closed whatever
        ends the exchange, so no queue slot, batch slot or KV block outlives it.
Rule 3: abrupt endings (the cuts, ``reset``, ``mid_*``) wait :data:`FLUSH_GRACE`, then end
        the ASGI call without the body's last message, so the server closes the
        connection without the chunked terminator; ``reset`` first closes the socket
        with a TCP RST where it can (:func:`~inference_lab.serve.harness.wire.reset_connection`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import attrs
import trio

from inference_lab.api.encoding import DONE_FRAME, new_request_id, usage
from inference_lab.api.requests import ParsedRequest, count_text_tokens
from inference_lab.core.config import FaultConfig
from inference_lab.core.engine import Finished
from inference_lab.errors import ApiError
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model_runtime import ModelRuntime, RequestHandle
from inference_lab.serve.error_replies import (
    STREAM_HEADERS,
    json_reply,
    send_reply,
    shutting_down_reply,
    stream_failure_frames,
)
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.harness.directives import Script
from inference_lab.serve.harness.frames import (
    CANCELLED_499,
    ERROR_400_IN_SSE,
    ERROR_ENVELOPE_200,
    FaultFrames,
    Frames,
)
from inference_lab.serve.harness.host import HarnessHost
from inference_lab.serve.harness.wire import (
    reset_connection,
    send_last,
    send_more,
    serve_stream,
)

__all__ = ["ABRUPT", "FLUSH_GRACE", "Fault", "Intercepted", "Scripted"]

#: Seconds an abrupt ending waits so the frames before it reach the wire first.
FLUSH_GRACE = 0.025
#: The endings that close the connection without the chunked terminator.
ABRUPT = frozenset(
    {"cut_between_frames", "cut_mid_frame", "reset", "mid_reasoning", "mid_tool_call"}
)


async def _end(
    frames: FaultFrames, exchange: Exchange, send: Send, tokens: int, reason: str
) -> None:
    """Apply the fault's ending after ``tokens`` content frames."""
    mode = frames.fault.mode
    if mode in ABRUPT:
        if mode == "cut_mid_frame":
            await send_more(send, frames.torn(tokens))
        await trio.sleep(FLUSH_GRACE)
        if mode == "reset":
            await reset_connection(send)
        return  # no last body message: the server closes without the chunked terminator
    if mode == "stall":
        await trio.sleep_forever()  # until the client leaves
    if mode == "error_envelope_200":
        data = ERROR_ENVELOPE_200 + DONE_FRAME
    elif mode == "error_400_in_sse":
        data = ERROR_400_IN_SSE
    elif mode == "cancelled_499":
        data = CANCELLED_499
    elif mode == "no_done":
        data = frames.closing(reason, tokens, with_usage=True, done=False)
    else:  # no_usage
        data = frames.closing(reason, tokens, with_usage=False, done=True)
    await send_last(send, data)


class Intercepted(Protocol):
    """A request the harness answers instead of the normal completion path."""

    async def serve(
        self,
        state: HarnessHost,
        runtime: ModelRuntime,
        exchange: Exchange,
        receive: Receive,
        send: Send,
    ) -> None:
        """Answer the request. May raise :class:`ApiError`, ``QueueFull`` or
        ``EngineUnavailable`` only before any response started (the caller answers)."""


class _PacedSink:
    """The sink of a paced fault's engine request: counts its tokens and wakes the writer
    (every method is synchronous, called by the engine task)."""

    __slots__ = ("emitted", "finished", "failure", "lot", "state")

    def __init__(self, state: HarnessHost) -> None:
        self.emitted = 0
        self.finished: Finished | None = None
        self.failure: str | None = None
        self.lot = trio.lowlevel.ParkingLot()
        self.state = state

    def on_tokens(self, count: int) -> None:
        self.emitted += count
        self.lot.unpark_all()

    def on_finished(self, finished: Finished) -> None:
        self.finished = finished
        self.lot.unpark_all()

    def on_failed(self, message: str) -> None:
        self.failure = self.state.shutdown_message or message
        self.lot.unpark_all()


@attrs.frozen
class Fault:
    """A fault-injected stream, bypassing the engine or paced by it (Rules 1 and 2)."""

    fault: FaultConfig
    parsed: ParsedRequest

    async def serve(
        self,
        state: HarnessHost,
        runtime: ModelRuntime,
        exchange: Exchange,
        receive: Receive,
        send: Send,
    ) -> None:
        if self.fault.paced:
            await self._serve_paced(state, runtime, exchange, receive, send)
            return
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        frames = FaultFrames(self.fault, self.parsed, new_request_id(self.parsed.kind), _now())
        fault = self.fault

        async def write() -> None:
            delay = fault.delay_ms / 1000.0
            opening = frames.opening()
            if opening:
                await send_more(send, opening)
            for i in range(fault.after_chunks):
                await trio.sleep(delay)
                await send_more(send, frames.content(i, i + 1))
            await trio.sleep(delay)
            await _end(frames, exchange, send, fault.after_chunks, "stop")

        await serve_stream(exchange, receive, send, write)

    async def _serve_paced(
        self,
        state: HarnessHost,
        runtime: ModelRuntime,
        exchange: Exchange,
        receive: Receive,
        send: Send,
    ) -> None:
        parsed = attrs.evolve(self.parsed, n=1)
        prompt = max(1, parsed.prompt_tokens)
        refused = runtime.check_fits(prompt, parsed.engine_max_tokens)
        if refused is not None:
            raise ApiError(400, "context_length_exceeded", refused.reason, "max_tokens")
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        frames = FaultFrames(self.fault, parsed, new_request_id(parsed.kind), _now())
        sink = _PacedSink(state)
        handle = runtime.admit_nowait(
            prompt_tokens=prompt,
            max_tokens=parsed.engine_max_tokens,
            priority=parsed.priority,
            sink=sink,
            arrival=exchange.arrival,
            limit=max(1, parsed.output_cap),
            drawn=False,  # the directive decides where the stream ends, never a drawn length
            session=parsed.session,
        )
        try:
            await serve_stream(
                exchange,
                receive,
                send,
                lambda: self._write_paced(frames, sink, handle, exchange, send),
                handle.close,
            )
        finally:
            handle.close()

    async def _write_paced(
        self,
        frames: FaultFrames,
        sink: _PacedSink,
        handle: RequestHandle,
        exchange: Exchange,
        send: Send,
    ) -> None:
        """Write the engine's tokens as they come, up to ``after_chunks``; then abort the
        engine request and apply the ending (an engine failure ends the stream with the
        engine-failed frames instead)."""
        limit = self.fault.after_chunks
        written = 0
        opening = frames.opening()
        if opening:
            await send_more(send, opening)
        while True:
            top = min(sink.emitted, limit)
            if sink.failure is not None:
                await send_last(
                    send, frames.content(written, top) + stream_failure_frames(sink.failure)
                )
                return
            if top > written:
                await send_more(send, frames.content(written, top))
                written = top
            if written >= limit or sink.finished is not None:
                handle.close()  # abort the engine request: its slot and blocks come back
                finished = sink.finished
                reason = finished.finish_reason if finished is not None else "stop"
                await _end(frames, exchange, send, written, reason)
                return
            await sink.lot.park()


@attrs.frozen
class Scripted:
    """A scripted answer: immediate, bypassing the engine."""

    script: Script
    parsed: ParsedRequest

    async def serve(
        self,
        state: HarnessHost,
        runtime: ModelRuntime,
        exchange: Exchange,
        receive: Receive,
        send: Send,
    ) -> None:
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        parsed, script = self.parsed, self.script
        request_id, created = new_request_id(parsed.kind), _now()
        calls = [
            {
                "index": i,
                "id": call.id if call.id is not None else f"call_directive_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for i, call in enumerate(script.tool_calls)
        ]
        generated = count_text_tokens(script.text or "") + sum(
            count_text_tokens(call.name) + count_text_tokens(call.arguments)
            for call in script.tool_calls
        )
        use = usage(parsed.prompt_tokens, generated)
        if not parsed.stream:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": script.text if script.text is not None or calls else "",
            }
            if calls:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in calls
                ]
            body = {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": parsed.model,
                "choices": [{"index": 0, "message": message, "finish_reason": script.reason}],
                "usage": use,
            }
            await send_reply(send, json_reply(body), exchange.headers)
            return
        frames = Frames(parsed, request_id, created)
        data = frames.chat({"role": "assistant"})
        if script.text:
            data += frames.chat({"content": script.text})
        if calls:
            data += frames.chat({"tool_calls": calls})
        tail = b',"finish_reason":' + dumps(script.reason)
        finish = frames.chat({}, tail)
        data += finish[: -len(b"}\n\n")] + b',"usage":' + dumps(use) + b"}\n\n" + DONE_FRAME
        headers = [*STREAM_HEADERS, *exchange.headers]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send_last(send, data)


def _now() -> int:
    return int(time.time())
