"""The test harness: faults on cue, scripted answers, engine kill / restart / slowdown.

Client test suites (SDK retries, gateway failover, circuit breakers, liveness probes) need
a server that fails the way real ones do. ``docs/test-harness.md`` is the user's guide;
this module guarantees the rules below.

Rule 1: off by default (``--enable-test-harness``, ``INFERENCE_LAB_ENABLE_TEST_HARNESS``).
        Off, the fault header is a 400, a scripted marker is ordinary prompt text and
        ``POST /control/engine`` is an unknown path (404); only a model's own ``[fault]``
        table applies, since the operator wrote it, not a client.
Rule 2: :meth:`Harness.intercept` runs after the model check (an unknown model is a 404
        first) and before fit and admission; a malformed directive is a 400
        ``invalid_fault_directive`` naming the problem, before any response starts. The
        header wins over a scripted marker, which wins over the model's ``[fault]`` table
        (drawn at its ``rate`` from a generator seeded by ``--seed``).
Rule 3: a fault or scripted response that bypasses the engine never touches a runtime: no
        fit check, no depth check (never a 529). A paced fault is admitted like any
        request (400 fit, 503, 529) and its engine request is aborted when the ending
        applies; its handle is closed whatever ends the exchange, so no queue slot, batch
        slot or KV block outlives it.
Rule 4: abrupt endings (the cuts, ``reset``, ``mid_*``) wait :data:`FLUSH_GRACE`, then end
        the ASGI call without the body's last message, so the server closes the
        connection without the chunked terminator. ``reset`` first arms ``SO_LINGER`` 0 on
        the connection's socket and closes it (a TCP RST) when :func:`connection_stream`
        finds it (hypercorn's trio worker: ``inference-lab serve`` and a plain hypercorn
        launch); elsewhere (an in-memory test client) it is a plain close.
Rule 5: engine control acts on one model: ``kill`` and ``slowdown`` synchronously (no
        checkpoint between the decision and the change), ``restart`` by starting a fresh
        runtime in the app's nursery (:meth:`ServeState.restart_runtime`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from inference_lab.api.encoding import DONE_FRAME, StreamEncoder, new_request_id, usage
from inference_lab.api.requests import ParsedRequest, count_text_tokens
from inference_lab.api.schema import parse_json_object
from inference_lab.api.text import VOCABULARY
from inference_lab.core.config import FAULT_MODES, FaultConfig
from inference_lab.core.engine import Finished
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.jsonbytes import dumps
from inference_lab.runtime.model import ModelRuntime, RequestHandle
from inference_lab.serve.exchange import Exchange, Receive, Send
from inference_lab.serve.responses import (
    STREAM_HEADERS,
    Reply,
    error_reply,
    json_reply,
    send_reply,
    shutting_down_reply,
    stream_failure_frames,
)
from inference_lab.validation import FieldError


class HarnessHost(Protocol):
    """What the harness needs of the app's serving state (``ServeState`` is one)."""

    @property
    def runtimes(self) -> Mapping[str, ModelRuntime]:
        """The served models' runtimes by name."""

    @property
    def draining(self) -> bool:
        """A shutdown has begun: new requests are refused."""

    @property
    def shutdown_message(self) -> str | None:
        """Set when a shutdown stopped the runtimes: the message live requests end with."""

    @property
    def harness(self) -> Harness:
        """The app's harness."""

    async def restart_runtime(self, name: str) -> ModelRuntime:
        """Replace model ``name``'s runtime by a fresh one; the new runtime."""

    def model_not_found(self, model: str) -> ApiError:
        """The 404 for a model the app does not serve."""


__all__ = [
    "ACTIONS",
    "HarnessHost",
    "CANCELLED_499",
    "ERROR_400_IN_SSE",
    "ERROR_ENVELOPE_200",
    "FAULT_HEADER",
    "FLUSH_GRACE",
    "MARKER",
    "MAX_STEP_TIME_FACTOR",
    "EngineCommand",
    "Harness",
    "Script",
    "ScriptedCall",
    "connection_stream",
    "find_script",
    "parse_engine_command",
    "parse_fault_header",
    "register_harness_routes",
]

logger = logging.getLogger("inference_lab.serve")

#: The request header carrying a fault directive.
FAULT_HEADER = b"x-inference-lab-fault"
#: What starts a scripted answer in a chat message; one JSON object follows it.
MARKER = "<<respond:"
#: Seconds an abrupt ending waits so the frames before it reach the wire first.
FLUSH_GRACE = 0.025
#: The endings that close the connection without the chunked terminator.
ABRUPT = frozenset(
    {"cut_between_frames", "cut_mid_frame", "reset", "mid_reasoning", "mid_tool_call"}
)
#: The engine-control actions of ``POST /control/engine``.
ACTIONS = ("kill", "restart", "slowdown")
#: Largest slowdown factor (a step of 10 ms then takes 10 s).
MAX_STEP_TIME_FACTOR = 1000.0

#: ``error_envelope_200``: OpenRouter's mid-stream error envelope on a 200 stream.
ERROR_ENVELOPE_200 = (
    b'data: {"error":{"message":"Provider returned error","code":502,'
    b'"metadata":{"provider_name":"inference-lab",'
    b'"raw":"simulated upstream provider failure (fault: error_envelope_200)"}}}\n\n'
)
#: ``error_400_in_sse``: vLLM's error object inside the stream (no ``error`` wrapper).
ERROR_400_IN_SSE = (
    b'data: {"object":"error","message":"This request would exceed the model\'s maximum '
    b'context length (fault: error_400_in_sse)","type":"BadRequestError","param":null,'
    b'"code":400}\n\n'
)
#: ``cancelled_499``: the frontend-cancellation body, exactly.
CANCELLED_499 = (
    b'data: {"error":{"code":499,"message":"CancelledError: ","type":"request_cancelled"}}\n\n'
)
#: ``cut_mid_frame;utf8=true``: the torn frame's text, whose 'é' (C3 A9) the cut splits.
UTF8_CUT_WORD = "café "
#: ``mid_tool_call``: the tool call whose arguments never finish.
TOOL_CALL_ID = "call_fault_0"
TOOL_CALL_NAME = "get_current_weather"
TOOL_CALL_ARGS_OPEN = '{"location":"San Francisco, CA","notes":"'
#: The same partial payloads as raw text, for ``/v1/completions`` (no delta objects).
COMPLETION_REASONING_OPEN = "<think>"
COMPLETION_TOOL_CALL_OPEN = (
    '{"name":"get_current_weather","arguments":{"location":"San Francisco, CA","notes":"'
)

_WORDS = tuple(f"{w} " for w in VOCABULARY)
_FINISH_REASONS = ("stop", "length", "tool_calls")
_DECODER = json.JSONDecoder()
_SCRIPT_KEYS = frozenset({"text", "tool_calls", "finish_reason"})
_CALL_KEYS = frozenset({"name", "arguments", "id"})


# ---------------------------------------------------------------------------------------
# directives


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_fault_directive", f"invalid fault directive: {message}", param)


def _flag(key: str, value: str) -> bool:
    if value in ("true", "false"):
        return value == "true"
    raise _invalid(f"{key} must be true or false, got {value!r}")


def _count(key: str, value: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 9:
        raise _invalid(f"{key} must be an integer >= 0, got {value!r}")
    return int(value)


def parse_fault_header(value: bytes) -> FaultConfig:
    """The directive of an ``x-inference-lab-fault`` header,
    ``<mode>[;after_chunks=N][;delay_ms=N][;utf8=true|false][;paced=true|false]``.
    Raises :class:`ApiError` 400 ``invalid_fault_directive`` naming the problem."""
    text = value.decode("latin-1").strip()
    mode, *params = (part.strip() for part in text.split(";"))
    if not mode:
        raise _invalid("empty; expected <mode>[;after_chunks=N][;delay_ms=N][;utf8=..][;paced=..]")
    if mode not in FAULT_MODES:
        raise _invalid(f"unknown mode {mode!r}; expected one of {', '.join(FAULT_MODES)}")
    fields: dict[str, Any] = {}
    for part in params:
        if not part:
            continue
        key, sep, raw = (p.strip() for p in part.partition("="))
        if not sep:
            raise _invalid(f"expected key=value, got {part!r}")
        if key in fields:
            raise _invalid(f"{key} is given twice")
        if key in ("after_chunks", "delay_ms"):
            fields[key] = _count(key, raw)
        elif key in ("utf8", "paced"):
            fields[key] = _flag(key, raw)
        else:
            raise _invalid(
                f"unknown parameter {key!r}; expected after_chunks, delay_ms, utf8, paced"
            )
    try:
        return FaultConfig(mode=mode, **fields)
    except FieldError as exc:
        raise _invalid(f"{exc.field} {exc}") from None
    except ValueError as exc:  # a range validator's Invalid names its field
        raise _invalid(f"{getattr(exc, 'field', None) or 'value'} {exc}") from None


@attrs.frozen(kw_only=True)
class ScriptedCall:
    """One tool call of a scripted answer; ``arguments`` is already the wire string."""

    name: str
    arguments: str
    id: str | None = None


@attrs.frozen(kw_only=True)
class Script:
    """A scripted answer (``<<respond:{...}``): what the server answers, exactly."""

    text: str | None = None
    tool_calls: tuple[ScriptedCall, ...] = ()
    finish_reason: str | None = None

    @property
    def reason(self) -> str:
        """The finish reason sent: the script's if it is ``stop``, ``length`` or
        ``tool_calls``; else ``tool_calls`` when there are calls, else ``stop``."""
        if self.finish_reason in _FINISH_REASONS:
            return self.finish_reason
        return "tool_calls" if self.tool_calls else "stop"


def _script_of(value: Any) -> Script | None:
    """The :class:`Script` a marker's JSON value describes, or None when it is malformed
    (not an object, an unknown key, a value of the wrong type)."""
    if type(value) is not dict or not value.keys() <= _SCRIPT_KEYS:
        return None
    text = value.get("text")
    reason = value.get("finish_reason")
    calls = value.get("tool_calls", [])
    if (text is not None and type(text) is not str) or (
        reason is not None and type(reason) is not str
    ):
        return None
    if type(calls) is not list:
        return None
    parsed: list[ScriptedCall] = []
    for call in calls:
        if type(call) is not dict or not call.keys() <= _CALL_KEYS:
            return None
        name, call_id = call.get("name"), call.get("id")
        if type(name) is not str or not name or (call_id is not None and type(call_id) is not str):
            return None
        arguments = call.get("arguments", {})
        # A string is sent as given (a client may script broken JSON on purpose).
        wire = arguments if type(arguments) is str else dumps(arguments).decode()
        parsed.append(ScriptedCall(name=name, arguments=wire, id=call_id))
    return Script(text=text, tool_calls=tuple(parsed), finish_reason=reason)


def _message_text(content: Any) -> str:
    if type(content) is str:
        return content
    if type(content) is list:
        return "".join(
            part["text"] for part in content if type(part) is dict and type(part.get("text")) is str
        )
    return ""


def find_script(raw: Mapping[str, Any]) -> Script | None:
    """The scripted answer of a chat body: the last well-formed ``<<respond:{json}``
    marker across its messages (whitespace may precede the object); malformed markers
    are ignored. None when there is none."""
    found: Script | None = None
    messages = raw.get("messages")
    if type(messages) is not list:
        return None
    for message in messages:
        text = _message_text(message.get("content")) if type(message) is dict else ""
        at = text.find(MARKER)
        while at >= 0:
            start = at + len(MARKER)
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                value, _ = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                value = None
            script = _script_of(value)
            if script is not None:
                found = script
            at = text.find(MARKER, start)
    return found


# ---------------------------------------------------------------------------------------
# frames


class _Frames:
    """The SSE frames of one harness response, built on the same head (id, object,
    created, model) as the engine's streams."""

    def __init__(self, parsed: ParsedRequest, request_id: str, created: int) -> None:
        self.parsed = parsed
        obj = b"chat.completion.chunk" if parsed.kind == "chat" else b"text_completion"
        self.head = b'data: {"id":%s,"object":"%s","created":%d,"model":%s,' % (
            dumps(request_id),
            obj,
            created,
            dumps(parsed.model),
        )

    def chat(self, delta: Mapping[str, Any], tail: bytes = b"") -> bytes:
        """A chat chunk of choice 0 carrying ``delta`` (``tail``: more choice keys)."""
        return self.head + b'"choices":[{"index":0,"delta":' + dumps(delta) + tail + b"}]}\n\n"

    def text(self, text: str) -> bytes:
        """A completions chunk of choice 0 carrying ``text``."""
        return self.head + b'"choices":[{"text":' + dumps(text) + b',"index":0}]}\n\n'


class _FaultFrames(_Frames):
    """The frames of one fault-injected stream (one choice): content frame ``i`` is the
    engine's token frame ``i`` (``mid_*``: reasoning or tool-call frames instead)."""

    def __init__(
        self, fault: FaultConfig, parsed: ParsedRequest, request_id: str, created: int
    ) -> None:
        one = attrs.evolve(parsed, n=1)
        super().__init__(one, request_id, created)
        self.fault = fault
        self.request_id, self.created = request_id, created
        self.encoder = StreamEncoder(one, request_id=request_id, created=created)

    def opening(self) -> bytes:
        return self.encoder.opening()

    def content(self, start: int, stop: int) -> bytes:
        """Content frames ``start .. stop-1``, joined."""
        mode = self.fault.mode
        if mode not in ("mid_reasoning", "mid_tool_call"):
            return self.encoder.tokens(start, stop)
        return b"".join(self._partial(i) for i in range(start, stop))

    def _partial(self, i: int) -> bytes:
        word = _WORDS[i % len(_WORDS)]
        chat = self.parsed.kind == "chat"
        if self.fault.mode == "mid_reasoning":
            if chat:
                return self.chat({"reasoning_content": word})
            return self.text(COMPLETION_REASONING_OPEN if i == 0 else word)
        if not chat:
            return self.text(COMPLETION_TOOL_CALL_OPEN if i == 0 else word)
        if i == 0:
            call = {
                "index": 0,
                "id": TOOL_CALL_ID,
                "type": "function",
                "function": {"name": TOOL_CALL_NAME, "arguments": ""},
            }
        else:
            fragment = TOOL_CALL_ARGS_OPEN if i == 1 else word
            call = {"index": 0, "function": {"arguments": fragment}}
        return self.chat({"tool_calls": [call]})

    def torn(self, i: int) -> bytes:
        """The first part of content frame ``i``: half its bytes, or (``utf8``) a frame
        carrying :data:`UTF8_CUT_WORD` cut between the two bytes of its 'é'."""
        if not self.fault.utf8:
            frame = self.content(i, i + 1)
            return frame[: len(frame) // 2]
        if self.parsed.kind == "chat":
            frame = self.chat({"content": UTF8_CUT_WORD})
        else:
            frame = self.text(UTF8_CUT_WORD)
        return frame[: frame.rindex("é".encode()) + 1]

    def closing(self, reason: str, tokens: int, *, with_usage: bool, done: bool) -> bytes:
        """The engine's end frames for ``tokens`` tokens: the finish frame, the usage
        frame when asked for (and ``with_usage``), ``[DONE]`` when ``done``."""
        encoder = self.encoder
        if not with_usage and self.parsed.include_usage:
            parsed = attrs.evolve(self.parsed, include_usage=False)
            encoder = StreamEncoder(parsed, request_id=self.request_id, created=self.created)
        frames = encoder.closing(reason, tokens)
        return frames if done else frames.removesuffix(DONE_FRAME)


# ---------------------------------------------------------------------------------------
# the wire


async def _send_more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _send_last(send: Send, data: bytes) -> None:
    with trio.CancelScope(shield=True):
        await send({"type": "http.response.body", "body": data, "more_body": False})


def _socket_stream(value: Any) -> trio.SocketStream | None:
    if isinstance(value, trio.SocketStream):
        return value
    if isinstance(value, trio.SSLStream) and isinstance(value.transport_stream, trio.SocketStream):
        return value.transport_stream
    return None


def _peer(stream: trio.SocketStream) -> tuple[str, int] | None:
    try:
        name = stream.socket.getpeername()
    except OSError:
        return None
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) else None


def connection_stream(scope: Mapping[str, Any]) -> trio.SocketStream | None:
    """The trio stream of the TCP connection the current task's request came on, or None.

    hypercorn's trio worker serves each connection in a task started by
    ``trio.serve_listeners``, whose coroutine holds the accepted stream (the same object
    as hypercorn's ``TCPServer.stream``), and runs the ASGI app in a task below it. So
    this walks from the current task up the task tree and looks at the local variables of
    each task's coroutine chain for a socket stream whose peer is ``scope["client"]``.
    """
    client = scope.get("client")
    if not client:
        return None
    want = (str(client[0]), int(client[1]))
    task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
    while task is not None:
        coro: Any = task.coro
        for _ in range(64):  # the coroutine chain (cr_await), bounded
            frame = getattr(coro, "cr_frame", None)
            if frame is not None:
                for value in list(frame.f_locals.values()):
                    stream = _socket_stream(value)
                    if stream is not None and _peer(stream) == want:
                        return stream
            coro = getattr(coro, "cr_await", None)
            if coro is None:
                break
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return None


async def _reset(scope: Mapping[str, Any]) -> bool:
    """Close the request's connection with a TCP RST (``SO_LINGER`` 0, then a close
    through trio, which wakes the server's reader). False when the socket was not found
    (then the caller's plain close is all there is)."""
    stream = connection_stream(scope)
    if stream is None:
        logger.warning("reset fault: the connection's socket was not found; closing with FIN")
        return False
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        return False  # the client is gone already
    with trio.CancelScope(shield=True):
        await stream.aclose()
    return True


async def _until_gone(
    receive: Receive, scope: trio.CancelScope, on_gone: Callable[[], None]
) -> None:
    """Wait for the client to leave; then call ``on_gone`` and cancel the writer."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            scope.cancel()
            return


async def _serve_stream(
    exchange: Exchange,
    receive: Receive,
    send: Send,
    write: Callable[[], Awaitable[None]],
    on_gone: Callable[[], None] = lambda: None,
) -> None:
    """Start a 200 event stream and run ``write`` until it returns or the client leaves.
    ``write`` ends the body itself, or returns without ending it (an abrupt ending)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_until_gone, receive, nursery.cancel_scope, on_gone)
        try:
            headers = [*STREAM_HEADERS, *exchange.headers]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await write()
        finally:
            nursery.cancel_scope.cancel()


async def _end(
    frames: _FaultFrames, exchange: Exchange, send: Send, tokens: int, reason: str
) -> None:
    """Apply the fault's ending after ``tokens`` content frames."""
    mode = frames.fault.mode
    if mode in ABRUPT:
        if mode == "cut_mid_frame":
            await _send_more(send, frames.torn(tokens))
        await trio.sleep(FLUSH_GRACE)
        if mode == "reset":
            await _reset(exchange.scope)
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
    await _send_last(send, data)


# ---------------------------------------------------------------------------------------
# what the harness answers


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
class _Fault:
    """A fault-injected stream (Rule 3: bypassing the engine, or paced by it)."""

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
        frames = _FaultFrames(self.fault, self.parsed, new_request_id(self.parsed.kind), _now())
        fault = self.fault

        async def write() -> None:
            delay = fault.delay_ms / 1000.0
            opening = frames.opening()
            if opening:
                await _send_more(send, opening)
            for i in range(fault.after_chunks):
                await trio.sleep(delay)
                await _send_more(send, frames.content(i, i + 1))
            await trio.sleep(delay)
            await _end(frames, exchange, send, fault.after_chunks, "stop")

        await _serve_stream(exchange, receive, send, write)

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
        refused = runtime.check_fits(prompt, parsed.max_tokens)
        if refused is not None:
            raise ApiError(400, "context_length_exceeded", refused.reason, "max_tokens")
        if state.draining:
            await send_reply(send, shutting_down_reply(), exchange.headers)
            return
        frames = _FaultFrames(self.fault, parsed, new_request_id(parsed.kind), _now())
        sink = _PacedSink(state)
        handle = runtime.admit_nowait(
            prompt_tokens=prompt,
            max_tokens=parsed.max_tokens,
            priority=parsed.priority,
            sink=sink,
            arrival=exchange.arrival,
            limit=parsed.output_cap,
        )
        try:
            await _serve_stream(
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
        frames: _FaultFrames,
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
            await _send_more(send, opening)
        while True:
            top = min(sink.emitted, limit)
            if sink.failure is not None:
                await _send_last(
                    send, frames.content(written, top) + stream_failure_frames(sink.failure)
                )
                return
            if top > written:
                await _send_more(send, frames.content(written, top))
                written = top
            if written >= limit or sink.finished is not None:
                handle.close()  # abort the engine request: its slot and blocks come back
                finished = sink.finished
                reason = finished.finish_reason if finished is not None else "stop"
                await _end(frames, exchange, send, written, reason)
                return
            await sink.lot.park()


@attrs.frozen
class _Scripted:
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
        frames = _Frames(parsed, request_id, created)
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
        await _send_last(send, data)


def _now() -> int:
    return int(time.time())


@attrs.define
class _TableFault:
    """A model's ``[fault]`` table and the generator its rate is drawn from."""

    fault: FaultConfig
    rng: random.Random

    def draw(self) -> bool:
        rate = self.fault.rate
        if rate >= 1.0:
            return True
        return rate > 0.0 and self.rng.random() < rate


class Harness:
    """The test harness of one app (see the module rules). Built by ``ServeState.build``;
    :meth:`intercept` is called by the completion route for every request."""

    def __init__(
        self, *, enabled: bool, faults: Sequence[tuple[str, FaultConfig]] = (), seed: int = 0
    ) -> None:
        self.enabled = enabled
        self._tables = {
            name: _TableFault(fault, random.Random(f"{seed}:{name}")) for name, fault in faults
        }
        #: Anything to look at beyond the header (cheap test on the hot path).
        self._active = enabled or bool(self._tables)

    def intercept(
        self, exchange: Exchange, raw: Mapping[str, Any], parsed: ParsedRequest
    ) -> Intercepted | None:
        """What answers this (validated, known-model) request instead of the normal path,
        or None. Raises :class:`ApiError` 400 ``invalid_fault_directive`` for a fault
        header with the harness off, on a non-streaming request, or malformed."""
        header = exchange.header(FAULT_HEADER)
        if header is not None:
            if not self.enabled:
                raise _invalid(
                    "the test harness is off (start the server with --enable-test-harness "
                    "or INFERENCE_LAB_ENABLE_TEST_HARNESS=1)"
                )
            fault = parse_fault_header(header)
            if not parsed.stream:
                raise _invalid("x-inference-lab-fault applies to streaming requests only", "stream")
            return _Fault(fault, parsed)
        if not self._active:
            return None
        if self.enabled and parsed.kind == "chat":
            script = find_script(raw)
            if script is not None:
                return _Scripted(script, parsed)
        table = self._tables.get(parsed.model)
        if table is not None and parsed.stream and table.draw():
            return _Fault(table.fault, parsed)
        return None


# ---------------------------------------------------------------------------------------
# engine control: POST /control/engine


@attrs.frozen(kw_only=True)
class EngineCommand:
    """A validated ``POST /control/engine`` body."""

    model: str
    action: Literal["kill", "restart", "slowdown"]
    factor: float | None = None


def _echo(value: Any) -> str:
    return truncate_echo(json.dumps(value, ensure_ascii=False))


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_value", message, param)


def parse_engine_command(raw: Mapping[str, Any]) -> EngineCommand:
    """Validate ``{"model": M, "action": "kill"|"restart"|"slowdown", "factor": x}``:
    ``factor`` (a number, 0 < x <= :data:`MAX_STEP_TIME_FACTOR`) with ``slowdown`` only;
    unknown keys are errors. Raises :class:`ApiError` 400 ``invalid_value``."""
    for key in raw:
        if key not in ("model", "action", "factor"):
            raise _bad(str(key), f"unknown field {_echo(key)} (allowed: model, action, factor)")
    model, action, factor = raw.get("model"), raw.get("action"), raw.get("factor")
    if type(model) is not str or not model:
        raise _bad("model", "model must be a model name (a non-empty string)")
    if action not in ACTIONS:
        raise _bad("action", f"action must be one of {', '.join(ACTIONS)}, got {_echo(action)}")
    if action != "slowdown":
        if factor is not None:
            raise _bad("factor", "factor applies to action slowdown only")
        return EngineCommand(model=model, action=action)
    # a bool is no number
    number = (
        float(factor) if isinstance(factor, (int, float)) and type(factor) is not bool else math.nan
    )
    if not (0 < number <= MAX_STEP_TIME_FACTOR):
        raise _bad(
            "factor",
            f"factor must be a number > 0 and <= {MAX_STEP_TIME_FACTOR:g}, got {_echo(factor)}",
        )
    return EngineCommand(model=model, action="slowdown", factor=float(number))


async def apply_engine_command(state: HarnessHost, command: EngineCommand) -> ModelRuntime:
    """Carry out ``command`` on its (existing) model; the model's runtime afterwards."""
    runtime = state.runtimes[command.model]
    if command.action == "kill":
        runtime.kill()
    elif command.action == "restart":
        runtime = await state.restart_runtime(command.model)
    else:
        assert command.factor is not None
        runtime.set_step_time_factor(command.factor)
    return runtime


def _response(reply: Reply) -> Response:
    response = Response(reply.body, status=reply.status, content_type=reply.content_type.decode())
    for name, value in reply.headers:
        response.headers[name.decode()] = value.decode()
    return response


def register_harness_routes(app: QuartTrio, state: HarnessHost) -> None:
    """Add ``POST /control/engine`` to ``app`` when the harness is on (off, nothing is
    added: the path answers 404 as any unknown path does). The gate's control-token rule
    covers it like every ``/control/*`` path."""
    if not state.harness.enabled:
        return

    @app.post("/control/engine")
    async def control_engine() -> Response:
        try:
            data = await request.get_data(cache=False, as_text=False)
            assert isinstance(data, bytes)
            command = parse_engine_command(parse_json_object(data))
            if command.model not in state.runtimes:
                raise state.model_not_found(command.model)
        except (ApiError, HTTPException) as exc:
            return _response(error_reply(exc, method=request.method, path=request.path))
        runtime = await apply_engine_command(state, command)
        body = {
            "model": runtime.name,
            "action": command.action,
            "alive": runtime.snapshot().alive,
            "step_time_factor": runtime.engine.step_time_factor,
        }
        return _response(json_reply(body))
