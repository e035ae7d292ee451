"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

Rule 1: ``/tokenize`` takes exactly one of ``prompt`` and ``messages`` and answers
        ``count == len(tokens)``; messages are rendered as for counting a chat prompt.
Rule 2: without a tokenizer file the ids are the byte rule's reversible ids, and a chat's
        count is the rendered text's, without the 5 % overhead chat usage adds.
Rule 3: bodies are validated as request bodies are (:mod:`inference_lab.api.schema`); an
        id the tokenizer does not have, or messages a chat template refuses, are a 400
        ``invalid_value`` naming the field.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_lab.api.schema import Message, chat_messages, expect, invalid_value, structure
from inference_lab.api.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from inference_lab.errors import truncate_echo
from inference_lab.jsonbytes import dumps

__all__ = [
    "DetokenizeRequest",
    "TokenizeRequest",
    "detokenize_body",
    "parse_detokenize_request",
    "parse_tokenize_request",
    "tokenize_body",
]


@attrs.frozen(kw_only=True)
class _TokenizeBody:
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = attrs.field(
        default=None, metadata=expect("a non-empty array of messages")
    )
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """A ``POST /tokenize`` body: exactly one of ``prompt`` (text) and ``messages`` (a
    chat, rendered as for counting). ``add_special_tokens`` None means vLLM's default:
    true for a prompt, false for messages rendered by a chat template."""

    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    tools: tuple[Any, ...] | None
    add_special_tokens: bool | None
    add_generation_prompt: bool


def parse_tokenize_request(raw: dict[str, Any]) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (400 ``invalid_value`` naming the field)."""
    body: _TokenizeBody = structure(raw, _TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_value("prompt", "send exactly one of prompt (a string) and messages")
    messages = None
    if body.messages is not None:
        if not body.messages:
            raise invalid_value("messages", "messages must be a non-empty array of messages")
        messages = tuple(chat_messages(body.messages, body.tools))
    return TokenizeRequest(
        model=body.model,
        prompt=body.prompt,
        messages=messages,
        tools=tuple(body.tools) if body.tools else None,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt is not False,
    )


def tokenize_body(request: TokenizeRequest, tokenizer: Tokenizer, *, max_model_len: int) -> bytes:
    """The ``/tokenize`` answer ``{"count":..,"max_model_len":..,"tokens":[..]}`` (Rules 1
    and 2). Raises ApiError 400 when a chat template refuses the messages."""
    if request.messages is not None:
        try:
            ids = tokenizer.encode_chat(
                request.messages,
                request.tools,
                add_generation_prompt=request.add_generation_prompt,
                add_special_tokens=request.add_special_tokens,
            )
        except ChatTemplateError as exc:
            raise invalid_value("messages", truncate_echo(str(exc))) from None
    else:
        add = request.add_special_tokens is not False
        ids = tokenizer.encode(request.prompt or "", add_special_tokens=add)
    return dumps({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """A ``POST /detokenize`` body: the token ids to turn back into text."""

    model: str | None = None
    tokens: list[int]


def parse_detokenize_request(raw: dict[str, Any]) -> DetokenizeRequest:
    """Validate a ``/detokenize`` body: ``tokens`` an array of integers >= 0."""
    result: DetokenizeRequest = structure(raw, DetokenizeRequest)
    for i, token in enumerate(result.tokens):
        if token < 0:
            raise invalid_value(
                f"tokens[{i}]",
                f"tokens[{i}] must be an integer >= 0, got {truncate_echo(str(token))}",
            )
    return result


def detokenize_body(request: DetokenizeRequest, tokenizer: Tokenizer) -> bytes:
    """The ``/detokenize`` answer ``{"prompt": text}``; 400 ``invalid_value`` (param
    ``tokens``) for an id the tokenizer does not have."""
    try:
        text = tokenizer.decode(request.tokens)
    except ValueError as exc:
        raise invalid_value("tokens", truncate_echo(str(exc))) from None
    return dumps({"prompt": text})
