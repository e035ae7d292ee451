"""Chat completion bodies and SSE frames of agent answers: tool calls, structured output,
reasoning (:mod:`inference_lab.api.agents`).

Rule 1: a stream sends one frame per engine token and choice, in the shapes vLLM and
        OpenAI send: ``reasoning_content`` and ``content`` deltas carry their token's
        text; a tool call's first token is a ``tool_calls`` delta with its ``index``,
        ``id``, ``type`` and ``function.name`` (``arguments`` empty), each later token a
        delta with its ``index`` and one piece of ``function.arguments``. The SDK's
        accumulation of the deltas equals the non-streaming message.
Rule 2: the finish reason is ``tool_calls`` for a complete tool-call answer, ``length``
        for a JSON answer the token budget cut, and the prose answer's own otherwise;
        ``usage.completion_tokens_details.reasoning_tokens`` counts reasoning tokens (of
        every choice) when the answer reasons.
Rule 3: the encoder is bound to the answer's length (``RequestHandle.length``) once the
        engine admitted it; frames are built per token from that layout, and the
        placeholder words' frames are built once per stream.
Rule 4: reasoning goes under each of ``reasoning_keys``: vLLM's ``reasoning`` and the
        older ``reasoning_content`` by default, in the message and in each delta; with
        none (``include_reasoning: false``) reasoning tokens are generated and counted but
        not sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference_lab.api.agents import AnswerPlan, Layout
from inference_lab.api.encoding import DONE_FRAME, usage
from inference_lab.api.requests import ParsedRequest
from inference_lab.api.text import WORDS
from inference_lab.errors import error_body
from inference_lab.jsonbytes import dumps, dumps_str

__all__ = ["REASONING_KEYS", "ChatAgentEncoder", "agent_usage", "chat_agent_body"]

#: Where reasoning goes by default (Rule 4): vLLM's field, then the older one.
REASONING_KEYS = ("reasoning", "reasoning_content")


def agent_usage(
    parsed: ParsedRequest,
    completion_tokens: int,
    layout: Layout,
    plan: AnswerPlan,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """``usage`` of ``parsed.n`` choices of ``completion_tokens`` tokens each (Rule 2),
    ``cached_tokens`` of the prompt found in the prefix cache."""
    out: dict[str, Any] = usage(parsed.prompt_tokens, completion_tokens * parsed.n, cached_tokens)
    if plan.ratio is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": layout.reasoning * parsed.n}
    return out


def _message(layout: Layout, ids: Sequence[str], keys: Sequence[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    calls = layout.calls()
    message["content"] = None if calls else layout.content_text()
    if layout.plan.ratio is not None:
        for key in keys:
            message[key] = layout.reasoning_text()
    if calls:
        message["tool_calls"] = [
            {
                "id": ids[number],
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
            for number, (call, arguments) in enumerate(calls)
        ]
    return message


def chat_agent_body(
    parsed: ParsedRequest,
    plan: AnswerPlan,
    *,
    request_id: str,
    created: int,
    completion_tokens: int,
    finish_reason: str,
    call_ids: Sequence[Sequence[str]],
    reasoning_keys: Sequence[str] = REASONING_KEYS,
    cached_tokens: int = 0,
) -> bytes:
    """The non-streaming ``chat.completion`` of an agent answer: ``parsed.n`` choices of
    ``completion_tokens`` tokens (the engine's ``Finished``), choice ``c``'s tool calls
    with ids ``call_ids[c]``, reasoning under ``reasoning_keys`` (Rule 4)."""
    layout = plan.layout(parsed, completion_tokens)
    reason = layout.finish_reason(parsed, finish_reason)
    choices = [
        {
            "index": c,
            "message": _message(layout, call_ids[c], reasoning_keys),
            "logprobs": None,
            "finish_reason": reason,
        }
        for c in range(parsed.n)
    ]
    return dumps(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": parsed.model,
            "choices": choices,
            "usage": agent_usage(parsed, completion_tokens, layout, plan, cached_tokens),
        }
    )


class ChatAgentEncoder:
    """The SSE frames of one streamed agent answer (the interface of
    :class:`~inference_lab.api.encoding.StreamEncoder` that the stream sinks use)."""

    __slots__ = ("_head", "_parsed", "_plan", "_ids", "_layout", "_words", "_keys")

    def __init__(
        self,
        parsed: ParsedRequest,
        plan: AnswerPlan,
        *,
        request_id: str,
        created: int,
        call_ids: Sequence[Sequence[str]],
        reasoning_keys: Sequence[str] = REASONING_KEYS,
    ) -> None:
        self._parsed = parsed
        self._plan = plan
        self._ids = call_ids
        self._keys = tuple(reasoning_keys)
        self._head = (
            f'data: {{"id":{dumps_str(request_id)},"object":"chat.completion.chunk",'
            f'"created":{created},"model":{dumps_str(parsed.model)},'
        ).encode("utf-8", "backslashreplace")
        self._layout: Layout | None = None
        #: (kind, word) -> the frames of that placeholder word in every choice
        self._words: dict[tuple[str, int], bytes] = {}

    def bind(self, length: int) -> None:
        """Fix the answer's length (Rule 3): called once admission drew it."""
        self._layout = self._plan.layout(self._parsed, length)

    def _frame(self, choice: int, delta: bytes) -> bytes:
        return self._head + b'"choices":[{"index":%d,"delta":' % choice + delta + b"}]}\n\n"

    def opening(self) -> bytes:
        return b"".join(self._frame(c, b'{"role":"assistant"}') for c in range(self._parsed.n))

    def prepare(self) -> None:
        """(Nothing to build ahead: frames are built per token.)"""

    def _text(self, kind: str, text: str) -> bytes:
        value = dumps(text)
        if kind == "reasoning":
            if not self._keys:
                return b""  # generated and counted, not sent (Rule 4)
            delta = b"{" + b",".join(b'"%s":' % k.encode() + value for k in self._keys) + b"}"
        else:
            delta = b'{"content":' + value + b"}"
        return b"".join(self._frame(c, delta) for c in range(self._parsed.n))

    def _token(self, layout: Layout, i: int) -> bytes:
        kind, number, text = layout.token(i)
        if kind == "reasoning" or kind == "content":
            word = i % len(WORDS)
            if text == WORDS[word]:  # a placeholder word: built once per stream
                cached = self._words.get((kind, word))
                if cached is None:
                    cached = self._words[(kind, word)] = self._text(kind, text)
                return cached
            return self._text(kind, text)
        out = []
        for c in range(self._parsed.n):
            if kind == "call":
                call = self._plan.calls[number]
                entry = (
                    b'{"index":%d,"id":' % number
                    + dumps(self._ids[c][number])
                    + b',"type":"function","function":{"name":'
                    + dumps(call.name)
                    + b',"arguments":""}}'
                )
            else:
                entry = b'{"index":%d,"function":{"arguments":' % number + dumps(text) + b"}}"
            out.append(self._frame(c, b'{"tool_calls":[' + entry + b"]}"))
        return b"".join(out)

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        """The frames of tokens ``start .. stop-1`` (one per token and choice)."""
        layout = self._layout
        assert layout is not None, "bind() first"
        return b"".join(self._token(layout, i) for i in range(start, min(stop, layout.length)))

    def closing(self, finish_reason: str, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The finish frame of each choice, the usage frame when asked for, ``[DONE]``
        (usage reports ``cached_tokens``, the engine's ``Finished.cached_tokens``)."""
        parsed = self._parsed
        layout = self._plan.layout(parsed, completion_tokens)
        reason = dumps(layout.finish_reason(parsed, finish_reason))
        frames = b"".join(
            self._head
            + b'"choices":[{"index":%d,"delta":{},"finish_reason":' % c
            + reason
            + b"}]}\n\n"
            for c in range(parsed.n)
        )
        if parsed.include_usage:
            use = dumps(agent_usage(parsed, completion_tokens, layout, self._plan, cached_tokens))
            frames += self._head + b'"choices":[],"usage":' + use + b"}\n\n"
        return frames + DONE_FRAME

    @staticmethod
    def failure(message: str) -> bytes:
        body = error_body(message, "server_error", "engine_failed", None)
        return b"data: " + body + b"\n\n" + DONE_FRAME
