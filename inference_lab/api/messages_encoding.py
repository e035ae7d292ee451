"""The Anthropic Messages API's answers: the ``message`` object, its stream of events, and
Anthropic's error envelope.

Rule 1: the content is the answer's :class:`~inference_lab.api.agents.Layout`: a
        ``thinking`` block (the reasoning, when the answer reasons), then a ``text`` block
        or one ``tool_use`` block per call (``id`` ``toolu_...``, ``input`` the call's
        arguments as an object; a call the token budget cut has the arguments emitted so
        far parsed as far as they go, ``{}`` when nothing parses).
Rule 2: ``stop_reason`` is ``tool_use`` for a complete tool-call answer, ``max_tokens``
        when the budget cut the answer, ``stop_sequence`` (with ``stop_sequence``) when a
        stop sequence ended it, ``end_turn`` otherwise. ``usage`` has ``input_tokens``
        (the prompt's tokens the prefix cache did not hold),
        ``cache_read_input_tokens`` (those it held), ``cache_creation_input_tokens`` 0 and
        ``output_tokens``.
Rule 3: a stream is Anthropic's event sequence, each ``event: <type>`` with its
        ``data``: ``message_start`` (the message with empty content and the prompt's
        usage), per engine token one ``content_block_delta`` (``thinking_delta``,
        ``text_delta`` or ``input_json_delta``; the token that opens a tool call is its
        ``content_block_start``), each block opened by ``content_block_start`` and closed
        by ``content_block_stop`` (a thinking block's ``signature_delta`` before it), then
        ``message_delta`` (stop reason, the final usage) and ``message_stop``. An engine
        failure ends it with an ``error`` event.
Rule 4: every error answer of the Messages routes is Anthropic's envelope
        ``{"type":"error","error":{"type":...,"message":...}}``, the type following the
        status (:data:`ERROR_TYPES`): a 529 is ``overloaded_error``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from inference_lab.api.agents import AnswerPlan, Layout
from inference_lab.api.encoding import random_hex
from inference_lab.api.messages_request import MessagesRequest
from inference_lab.jsonbytes import dumps

__all__ = [
    "ERROR_TYPES",
    "MessageIds",
    "MessagesEncoder",
    "anthropic_error_body",
    "message_body",
]

#: Anthropic's error type of each status (Rule 4); any other 4xx is an
#: ``invalid_request_error``, any other 5xx an ``api_error``.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error envelope for ``status`` (Rule 4)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return dumps({"type": "error", "error": {"type": kind, "message": message}})


class MessageIds:
    """The ids of one message and of its tool calls (fixed before the first event)."""

    __slots__ = ("message", "calls")

    def __init__(self, calls: int) -> None:
        self.message = f"msg_{random_hex()}"
        self.calls = tuple(f"toolu_{random_hex()[:24]}" for _ in range(calls))


def _signature(thinking: str) -> str:
    """A thinking block's ``signature``: a digest of its text (the server signs nothing;
    a client sends it back unchanged)."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


def _partial_input(arguments: str) -> Any:
    """A call's arguments as an object: all of them, or as much of a cut document as
    parses (Rule 1)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


def stop_reason(request: MessagesRequest, layout: Layout, engine_reason: str) -> str:
    """Rule 2's ``stop_reason``."""
    reason = layout.finish_reason(request.parsed, engine_reason)
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    if request.stop_sequence(layout.length) is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(request: MessagesRequest, output_tokens: int, cached: int) -> dict[str, Any]:
    prompt = request.parsed.prompt_tokens
    return {
        "input_tokens": max(0, prompt - cached),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _content(layout: Layout, ids: MessageIds) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if layout.plan.ratio is not None and layout.reasoning:
        thinking = layout.reasoning_text()
        blocks.append({"type": "thinking", "thinking": thinking, "signature": _signature(thinking)})
    calls = layout.calls()
    if calls:
        for number, (call, arguments) in enumerate(calls):
            blocks.append(
                {
                    "type": "tool_use",
                    "id": ids.calls[number],
                    "name": call.name,
                    "input": _partial_input(arguments),
                }
            )
    elif layout.length > layout.reasoning or not blocks:
        blocks.append({"type": "text", "text": layout.content_text()})
    return blocks


def message_body(
    request: MessagesRequest,
    plan: AnswerPlan,
    ids: MessageIds,
    *,
    completion_tokens: int,
    finish_reason: str,
    cached_tokens: int,
) -> dict[str, Any]:
    """The ``message`` of an answer of ``completion_tokens`` tokens (the engine's
    ``Finished``): the non-streaming body (Rules 1-2)."""
    layout = plan.layout(request.parsed, completion_tokens)
    return {
        "id": ids.message,
        "type": "message",
        "role": "assistant",
        "model": request.parsed.model,
        "content": _content(layout, ids),
        "stop_reason": stop_reason(request, layout, finish_reason),
        "stop_sequence": request.stop_sequence(completion_tokens),
        "usage": _usage(request, completion_tokens, cached_tokens),
    }


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"


class MessagesEncoder:
    """The events of one streamed message (Rule 3), with the interface of
    :class:`~inference_lab.api.encoding.StreamEncoder` the stream sinks use. It keeps the
    open block, so tokens must be asked for in order (as a sink does)."""

    def __init__(self, request: MessagesRequest, plan: AnswerPlan, ids: MessageIds) -> None:
        self.request = request
        self.plan = plan
        self.ids = ids
        self._layout: Layout | None = None
        #: the open block: ("thinking" | "text" | "tool_use", call number), and its index
        self._open: tuple[str, int] | None = None
        self._index = -1
        self._thinking: list[str] = []

    def bind(self, length: int) -> None:
        self._layout = self.plan.layout(self.request.parsed, length)

    def opening(self) -> bytes:
        request = self.request
        message: dict[str, Any] = {
            "id": self.ids.message,
            "type": "message",
            "role": "assistant",
            "model": request.parsed.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(request, 1, 0),
        }
        return _event("message_start", {"message": message})

    def prepare(self) -> None:
        """(Nothing to build ahead: events are built per token.)"""

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        data = b""
        if self._open[0] == "thinking":
            signature = _signature("".join(self._thinking))
            delta = {"type": "signature_delta", "signature": signature}
            data = _event("content_block_delta", {"index": self._index, "delta": delta})
        self._open = None
        return data + _event("content_block_stop", {"index": self._index})

    def _start(self, kind: str, number: int = 0) -> bytes:
        data = self._close()
        self._open = (kind, number)
        self._index += 1
        if kind == "thinking":
            block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            call = self.plan.calls[number]
            block = {
                "type": "tool_use",
                "id": self.ids.calls[number],
                "name": call.name,
                "input": {},
            }
        return data + _event("content_block_start", {"index": self._index, "content_block": block})

    def _token(self, layout: Layout, i: int) -> bytes:
        kind, number, text = layout.token(i)
        if kind == "reasoning":
            data = b"" if self._open == ("thinking", 0) else self._start("thinking")
            self._thinking.append(text)
            delta: dict[str, Any] = {"type": "thinking_delta", "thinking": text}
        elif kind == "content":
            data = b"" if self._open == ("text", 0) else self._start("text")
            delta = {"type": "text_delta", "text": text}
        elif kind == "call":
            return self._start("tool_use", number)
        else:
            data = b""
            delta = {"type": "input_json_delta", "partial_json": text}
        return data + _event("content_block_delta", {"index": self._index, "delta": delta})

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        layout = self._layout
        assert layout is not None, "bind() first"
        return b"".join(self._token(layout, i) for i in range(start, min(stop, layout.length)))

    def closing(self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The open block's end, then ``message_delta`` and ``message_stop`` (Rule 3)."""
        request = self.request
        layout = self.plan.layout(request.parsed, completion_tokens)
        data = b""
        if self._index < 0:  # nothing streamed: the body's one (empty) text block
            data = self._start("text")
        data += self._close()
        delta = {
            "stop_reason": stop_reason(request, layout, finish_reason),
            "stop_sequence": request.stop_sequence(completion_tokens),
        }
        usage = _usage(request, completion_tokens, cached_tokens)
        return (
            data
            + _event("message_delta", {"delta": delta, "usage": usage})
            + _event("message_stop", {})
        )

    def failure(self, message: str) -> bytes:
        """The event ending a stream whose engine failed (or stopped)."""
        return _event("error", {"error": {"type": "api_error", "message": message}})
