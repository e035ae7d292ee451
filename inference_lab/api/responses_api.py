"""``/v1/responses``: the Responses API's request, its response object and its events.

A Responses request is parsed into the same values a chat request is (a
:class:`~inference_lab.api.requests.ParsedRequest` for the engine, an
:class:`~inference_lab.api.agents.AgentRequest` for the answer's shape) plus what the
response object echoes; its answer is laid out by :mod:`inference_lab.api.agents`.

Rule 1: ``input`` (a string, or message, ``function_call`` and ``function_call_output``
        items), ``instructions`` and the conversation of ``previous_response_id`` are
        counted as chat messages by the model's tokenizer, with the function tools.
Rule 2: the output is a ``reasoning`` item (when the answer reasons), then a ``message``
        (prose or structured output) or one ``function_call`` item per call; ids are
        fixed before the first event, so the streamed items and the final response agree.
Rule 3: a stream is ``response.created``, ``response.in_progress``, then per engine
        token one event (a text, reasoning-text or arguments delta; the token that opens
        a tool call is its ``output_item.added``), each item opened with
        ``output_item.added`` (and ``content_part.added``) and closed with its ``.done``
        events, and last ``response.completed`` (or ``response.incomplete``) carrying the
        whole response with usage. Every event has the next ``sequence_number``.
Rule 4: a response is ``incomplete`` (reason ``max_output_tokens``) when the client's
        ``max_output_tokens`` cut it: a JSON answer cut short, or a prose answer that
        reached it; a prose answer that ran to the server's default length completed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs

from inference_lab.api.agents import (
    AnswerPlan,
    Layout,
    call_id,
)
from inference_lab.api.encoding import random_hex
from inference_lab.api.responses_request import ResponsesRequest
from inference_lab.api.tokenizer import ChatMessage
from inference_lab.jsonbytes import dumps

__all__ = [
    "ResponseIds",
    "ResponsesEncoder",
    "response_object",
]


@attrs.frozen(kw_only=True)
class ResponseIds:
    """The ids of one response and of its output items (Rule 2)."""

    response: str
    reasoning: str
    message: str
    calls: tuple[str, ...]
    call_items: tuple[str, ...]

    @classmethod
    def new(cls, calls: int) -> ResponseIds:
        return cls(
            response=f"resp_{random_hex()}",
            reasoning=f"rs_{random_hex()}",
            message=f"msg_{random_hex()}",
            calls=tuple(call_id() for _ in range(calls)),
            call_items=tuple(f"fc_{random_hex()}" for _ in range(calls)),
        )


def _finished(request: ResponsesRequest, layout: Layout, engine_reason: str) -> bool:
    """Whether the response completed (Rule 4)."""
    if layout.plan.fixed is not None:
        return layout.complete
    return not (request.capped and engine_reason == "length")


def _reasoning_item(ids: ResponseIds, text: str, status: str) -> dict[str, Any]:
    return {
        "id": ids.reasoning,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(ids: ResponseIds, text: str, status: str) -> dict[str, Any]:
    return {
        "id": ids.message,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(
    ids: ResponseIds, number: int, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": ids.call_items[number],
        "type": "function_call",
        "status": status,
        "call_id": ids.calls[number],
        "name": name,
        "arguments": arguments,
    }


def output_items(layout: Layout, ids: ResponseIds, *, completed: bool) -> list[dict[str, Any]]:
    """The response's output (Rule 2); the last item is ``incomplete`` unless it
    ``completed``."""
    items: list[dict[str, Any]] = []
    if layout.plan.ratio is not None and layout.reasoning:
        items.append(_reasoning_item(ids, layout.reasoning_text(), "completed"))
    calls = layout.calls()
    if calls:
        for number, (call, arguments) in enumerate(calls):
            items.append(_call_item(ids, number, call.name, arguments, "completed"))
    elif layout.length > layout.reasoning or not items:
        items.append(_message_item(ids, layout.content_text(), "completed"))
    if not completed:
        items[-1]["status"] = "incomplete"
    return items


def response_usage(request: ResponsesRequest, layout: Layout) -> dict[str, Any]:
    prompt = request.parsed.prompt_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": layout.length,
        "output_tokens_details": {"reasoning_tokens": layout.reasoning},
        "total_tokens": prompt + layout.length,
    }


def response_object(
    request: ResponsesRequest,
    ids: ResponseIds,
    *,
    created_at: int,
    status: str,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object in OpenAI's key order."""
    echo = request.echo
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": None,
        "model": request.parsed.model,
        "output": output if output is not None else [],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": echo["effort"], "summary": None},
        "store": request.store,
        "temperature": echo["temperature"],
        "text": echo["text"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_p": echo["top_p"],
        "truncation": echo["truncation"],
        "usage": usage,
        "user": echo["user"],
        "metadata": echo["metadata"],
    }


def final_response(
    request: ResponsesRequest,
    plan: AnswerPlan,
    ids: ResponseIds,
    *,
    created_at: int,
    completion_tokens: int,
    finish_reason: str,
) -> dict[str, Any]:
    """The finished response of ``completion_tokens`` tokens (the engine's
    ``Finished``): the non-streaming body, and the last event's ``response``."""
    layout = plan.layout(request.parsed, completion_tokens)
    completed = _finished(request, layout, finish_reason)
    return response_object(
        request,
        ids,
        created_at=created_at,
        status="completed" if completed else "incomplete",
        output=output_items(layout, ids, completed=completed),
        usage=response_usage(request, layout),
    )


def response_messages(
    request: ResponsesRequest, body: Mapping[str, Any]
) -> tuple[ChatMessage, ...]:
    """The conversation a follow-up with ``previous_response_id`` continues: this
    request's messages and its answer (a stored response, Rule 1)."""
    out = list(request.messages)
    calls = []
    for item in body.get("output", ()):
        if item["type"] == "message":
            out.append(ChatMessage("assistant", item["content"][0]["text"]))
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    if calls:
        out.append(ChatMessage("assistant", "", calls))
    return tuple(out)


class ResponsesEncoder:
    """The events of one streamed response (Rule 3), with the interface of
    :class:`~inference_lab.api.encoding.StreamEncoder` that the stream sinks use. It keeps
    the open item and the next sequence number, so tokens must be asked for in order
    (as a sink does)."""

    def __init__(
        self, request: ResponsesRequest, plan: AnswerPlan, ids: ResponseIds, *, created_at: int
    ) -> None:
        self.request = request
        self.plan = plan
        self.ids = ids
        self.created_at = created_at
        self.sequence = 0
        self._layout: Layout | None = None
        #: the open item: ("reasoning" | "message" | "call", call number), its index, text
        self._open: tuple[str, int] | None = None
        self._index = -1
        self._pieces: list[str] = []
        #: the finished response (set by :meth:`closing`), for the store
        self.final: dict[str, Any] | None = None

    def bind(self, length: int) -> None:
        self._layout = self.plan.layout(self.request.parsed, length)

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"

    def opening(self) -> bytes:
        shell = response_object(
            self.request, self.ids, created_at=self.created_at, status="in_progress"
        )
        return self._event("response.created", {"response": shell}) + self._event(
            "response.in_progress", {"response": shell}
        )

    def prepare(self) -> None:
        """(Nothing to build ahead: events are built per token.)"""

    def _close(self, status: str) -> bytes:
        """The ``.done`` events of the open item."""
        if self._open is None:
            return b""
        kind, number = self._open
        text = "".join(self._pieces)
        index = self._index
        self._open = None
        if kind == "reasoning":
            item_id = self.ids.reasoning
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            return (
                self._event(
                    "response.reasoning_text.done",
                    {"item_id": item_id, "output_index": index, "content_index": 0, "text": text},
                )
                + self._event(
                    "response.content_part.done",
                    {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
                )
                + self._event(
                    "response.output_item.done",
                    {"output_index": index, "item": _reasoning_item(self.ids, text, status)},
                )
            )
        if kind == "message":
            item_id = self.ids.message
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return (
                self._event(
                    "response.output_text.done",
                    {
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    },
                )
                + self._event(
                    "response.content_part.done",
                    {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
                )
                + self._event(
                    "response.output_item.done",
                    {"output_index": index, "item": _message_item(self.ids, text, status)},
                )
            )
        name = self.plan.calls[number].name
        item_id = self.ids.call_items[number]
        return self._event(
            "response.function_call_arguments.done",
            {"item_id": item_id, "output_index": index, "name": name, "arguments": text},
        ) + self._event(
            "response.output_item.done",
            {"output_index": index, "item": _call_item(self.ids, number, name, text, status)},
        )

    def _open_item(self, kind: str, number: int) -> bytes:
        data = self._close("completed")
        self._open = (kind, number)
        self._index += 1
        self._pieces = []
        index = self._index
        if kind == "reasoning":
            item = _reasoning_item(self.ids, "", "in_progress")
            item["content"] = []
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            item_id = self.ids.reasoning
        elif kind == "message":
            item = _message_item(self.ids, "", "in_progress")
            item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item_id = self.ids.message
        else:
            call = self.plan.calls[number]
            item = _call_item(self.ids, number, call.name, "", "in_progress")
            return data + self._event(
                "response.output_item.added", {"output_index": index, "item": item}
            )
        return (
            data
            + self._event("response.output_item.added", {"output_index": index, "item": item})
            + self._event(
                "response.content_part.added",
                {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
            )
        )

    def _token(self, layout: Layout, i: int) -> bytes:
        kind, number, text = layout.token(i)
        index = self._index
        if kind == "reasoning":
            data = b"" if self._open == ("reasoning", 0) else self._open_item("reasoning", 0)
            self._pieces.append(text)
            return data + self._event(
                "response.reasoning_text.delta",
                {
                    "item_id": self.ids.reasoning,
                    "output_index": self._index,
                    "content_index": 0,
                    "delta": text,
                },
            )
        if kind == "content":
            data = b"" if self._open == ("message", 0) else self._open_item("message", 0)
            self._pieces.append(text)
            return data + self._event(
                "response.output_text.delta",
                {
                    "item_id": self.ids.message,
                    "output_index": self._index,
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                },
            )
        if kind == "call":
            return self._open_item("call", number)
        del index
        self._pieces.append(text)
        return self._event(
            "response.function_call_arguments.delta",
            {"item_id": self.ids.call_items[number], "output_index": self._index, "delta": text},
        )

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        layout = self._layout
        assert layout is not None, "bind() first"
        return b"".join(self._token(layout, i) for i in range(start, min(stop, layout.length)))

    def closing(self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The open item's ``.done`` events, then ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        final = final_response(
            self.request,
            self.plan,
            self.ids,
            created_at=self.created_at,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
        )
        self.final = final
        status = final["status"]
        data = self._close(status)
        if self._index < 0:  # nothing was streamed (an answer of no content token)
            for index, item in enumerate(final["output"]):
                data += self._event(
                    "response.output_item.added", {"output_index": index, "item": item}
                )
                data += self._event(
                    "response.output_item.done", {"output_index": index, "item": item}
                )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return data + self._event(kind, {"response": final})

    def failure(self, message: str) -> bytes:
        """The event ending a stream whose engine failed."""
        return self._event("error", {"code": "engine_failed", "message": message, "param": None})


def now() -> int:
    return int(time.time())
