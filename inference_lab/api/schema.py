"""The schema of the HTTP bodies the server reads, and the strict converter behind it.

Only the fields the server uses are declared; the rest of a body is ignored. The parse
functions of :mod:`inference_lab.api.requests` and :mod:`inference_lab.api.tokenize` turn
these schemas into the values the server acts on.

Rule 1: every body goes through one strict cattrs converter built on
        :mod:`inference_lab.validation`: scalars are never coerced (``7.9`` is not an int,
        ``"false"`` is not a bool, ``true`` is not an int) and a string with a lone
        surrogate is refused.
Rule 2: request bodies ignore unknown keys (OpenAI clients send many); control bodies
        (``strict=True``) refuse them.
Rule 3: every failure is an :class:`ApiError` 400 ``invalid_value`` whose ``param`` names
        the field path; no client input makes :func:`structure` raise anything else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NewType

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from inference_lab.api.tokenizer import ChatMessage
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.validation import (
    FieldError,
    Invalid,
    check_unicode,
    error_leaves,
    make_strict_converter,
)

__all__ = [
    "MAX_LOGPROBS_COMPLETIONS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_TOOL_DEPTH",
    "MAX_TOP_LOGPROBS_CHAT",
    "ChatBody",
    "CompletionBody",
    "Message",
    "StreamOptions",
    "chat_messages",
    "check_depth",
    "expect",
    "in_range",
    "invalid_value",
    "parse_json_object",
    "structure",
]

#: ``n`` is 1..MAX_N (OpenAI's bound).
MAX_N = 128
#: ``stop`` holds at most this many strings (OpenAI's bound).
MAX_STOP_STRINGS = 4
#: The largest ``max_tokens``, ``best_of`` and ``|priority|`` accepted (vLLM's fields are
#: 32-bit): a larger number is refused by its range, so no message quotes it whole.
MAX_INT32 = 2**31 - 1
#: Chat ``top_logprobs`` and completions ``logprobs`` bounds (OpenAI's).
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
#: ``tools`` and ``tool_calls`` may nest at most this deep (they are serialised to count).
MAX_TOOL_DEPTH = 64


def invalid_value(param: str, message: str) -> ApiError:
    """The 400 ``invalid_value`` naming ``param``."""
    return ApiError(400, "invalid_value", message, param)


def _render(value: Any) -> str:
    """A short JSON rendering of a bad value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def in_range(lo: int, hi: int | None = None) -> Any:
    """An attrs validator: None, or an int in ``lo..hi``."""
    expected = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"

    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and (value < lo or (hi is not None and value > hi)):
            raise Invalid(expected, value, attr.name)

    return check


def _nonempty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise Invalid("a non-empty array", value, attr.name)


def expect(text: str) -> dict[str, str]:
    """Field metadata: what an error message says the field must be."""
    return {"expect": text}


Content = NewType("Content", object)  # str | list[part] | None, checked by _content_hook
Prompt = NewType("Prompt", object)  # the four completions prompt forms, see _prompt_hook
Stop = NewType("Stop", object)  # None | str | [str, ...], see _stop_hook

_STOP_EXPECT = f"a non-empty string or an array of at most {MAX_STOP_STRINGS} non-empty strings"
_PROMPT_EXPECT = (
    "a string, an array of strings, an array of token ids or an array of token-id arrays"
)


@attrs.frozen(kw_only=True)
class _ContentPart:
    text: str | None = None


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class Message:
    """A chat message; ``content`` is its text (parts without text add nothing)."""

    role: str
    content: Content = attrs.field(
        default=None,
        metadata=expect("a string, an array of content parts, or null"),
    )
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    #: An earlier answer's reasoning: vLLM's ``reasoning``, or the older
    #: ``reasoning_content`` (both accepted; ``reasoning`` wins).
    reasoning: str | None = None
    reasoning_content: str | None = None


@attrs.frozen(kw_only=True)
class ChatBody:
    """A ``/v1/chat/completions`` body."""

    model: str
    messages: list[Message] = attrs.field(
        validator=_nonempty, metadata=expect("a non-empty array of messages")
    )
    max_completion_tokens: int | None = attrs.field(
        default=None,
        validator=in_range(1, MAX_INT32),
        metadata=expect(f"an integer in 1..{MAX_INT32}"),
    )
    max_tokens: int | None = attrs.field(
        default=None,
        validator=in_range(1, MAX_INT32),
        metadata=expect(f"an integer in 1..{MAX_INT32}"),
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None
    priority: int | None = attrs.field(default=None, validator=in_range(-MAX_INT32, MAX_INT32))
    n: int | None = attrs.field(default=None, validator=in_range(1, MAX_N))
    best_of: int | None = attrs.field(default=None, validator=in_range(1, MAX_N))
    stop: Stop = attrs.field(default=None)
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(
        default=None, validator=in_range(0, MAX_TOP_LOGPROBS_CHAT)
    )
    ignore_eos: bool | None = None
    min_tokens: int | None = attrs.field(default=None, validator=in_range(0, MAX_INT32))
    #: OpenAI's keys for requests that share a cache (``api/requests.py`` Rule 5)
    prompt_cache_key: str | None = None
    user: str | None = None


@attrs.frozen(kw_only=True)
class CompletionBody:
    """A ``/v1/completions`` body; ``prompt`` is a tuple of prompts (each a ``str`` or a
    ``tuple`` of token ids)."""

    model: str
    prompt: Prompt = attrs.field(metadata=expect(_PROMPT_EXPECT))
    max_tokens: int | None = attrs.field(
        default=None,
        validator=in_range(0, MAX_INT32),
        metadata=expect(f"an integer in 0..{MAX_INT32}"),
    )
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    priority: int | None = attrs.field(default=None, validator=in_range(-MAX_INT32, MAX_INT32))
    n: int | None = attrs.field(default=None, validator=in_range(1, MAX_N))
    best_of: int | None = attrs.field(default=None, validator=in_range(1, MAX_N))
    stop: Stop = attrs.field(default=None)
    logprobs: int | None = attrs.field(
        default=None, validator=in_range(0, MAX_LOGPROBS_COMPLETIONS)
    )
    ignore_eos: bool | None = None
    min_tokens: int | None = attrs.field(default=None, validator=in_range(0, MAX_INT32))
    #: OpenAI's keys for requests that share a cache (``api/requests.py`` Rule 5)
    prompt_cache_key: str | None = None
    user: str | None = None


def _is_token_ids(value: Any) -> bool:
    return type(value) is list and all(type(t) is int and t >= 0 for t in value)


def _prompt_hook(value: Any, _type: Any) -> Any:
    """One of ``str``, ``[str, ...]``, ``[int, ...]``, ``[[int, ...], ...]``; returns a
    tuple of prompts (each ``str`` or ``tuple[int, ...]``). The count is checked later."""
    if type(value) is str:
        prompts: tuple[Any, ...] = (value,)
    elif type(value) is not list:
        raise Invalid(_PROMPT_EXPECT, value)
    elif not value:
        return ()
    elif all(type(p) is str for p in value):
        prompts = tuple(value)
    elif _is_token_ids(value):
        return (tuple(value),)
    elif all(_is_token_ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    else:
        raise Invalid(_PROMPT_EXPECT, value)
    if not all(check_unicode(p) for p in prompts):
        raise Invalid("valid Unicode (no lone surrogate escapes)", value)
    return prompts


def _content_hook(value: Any, _type: Any) -> Any:
    """Message content: a string, null, or an array of parts whose ``text`` fields are
    concatenated (parts without text, e.g. images, add nothing). Returns the text."""
    if value is None:
        return ""
    if type(value) is str:
        if not check_unicode(value):
            raise Invalid("a string of valid Unicode (no lone surrogate escapes)", value)
        return value
    if type(value) is list:
        parts = _CONVERTER.structure(value, list[_ContentPart])
        return "".join(p.text for p in parts if p.text is not None)
    raise Invalid("a string, an array of content parts, or null", value)


def _stop_hook(value: Any, _type: Any) -> Any:
    """``stop``: null, a string, or an array of up to 4 strings; none may be empty.
    Returns a tuple of the stop strings (empty for null or [])."""
    if value is None:
        return ()
    items = [value] if type(value) is str else value
    if (
        type(items) is not list
        or len(items) > MAX_STOP_STRINGS
        or not all(type(s) is str and s for s in items)
    ):
        raise Invalid(_STOP_EXPECT, value)
    if not all(check_unicode(s) for s in items):
        raise Invalid("valid Unicode (no lone surrogate escapes)", value)
    return tuple(items)


def _make_converter(forbid_extra_keys: bool) -> cattrs.Converter:
    conv = make_strict_converter(forbid_extra_keys=forbid_extra_keys)
    conv.register_structure_hook(Content, _content_hook)
    conv.register_structure_hook(Prompt, _prompt_hook)
    conv.register_structure_hook(Stop, _stop_hook)
    return conv


_CONVERTER = _make_converter(forbid_extra_keys=False)  # request bodies: extra keys ignored
_STRICT_CONVERTER = _make_converter(forbid_extra_keys=True)  # control bodies: none allowed


def structure(raw: dict[str, Any], cls: type[Any], *, strict: bool = False) -> Any:
    """``raw`` as an instance of the schema ``cls`` (Rules 1-3); ``strict`` refuses
    unknown keys."""
    converter = _STRICT_CONVERTER if strict else _CONVERTER
    try:
        return converter.structure(raw, cls)
    except Exception as exc:  # noqa: BLE001 - every structuring failure becomes an ApiError
        leaves = error_leaves(exc, "", cls)
        path, leaf, meta = leaves[0] if leaves else ("", exc, {})
        if isinstance(leaf, ForbiddenExtraKeysError):
            key = truncate_echo(sorted(leaf.extra_fields)[0])
            allowed = ", ".join(a.name for a in attrs.fields(cls))
            raise invalid_value(key, f"unknown field '{key}' (allowed: {allowed})") from None
        if isinstance(leaf, KeyError):
            raise invalid_value(path, f"{path} is required") from None
        if isinstance(leaf, Invalid):
            expected = meta.get("expect", leaf.expected)
            message = f"{path} must be {expected}, got {_render(leaf.value)}"
            raise invalid_value(path, message) from None
        if isinstance(leaf, FieldError):
            raise invalid_value(path, f"{path} {leaf}") from None
        where = path or "body"
        raise invalid_value(where, f"{where}: {truncate_echo(str(leaf))}") from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object (400 ``invalid_json`` else,
    including a body nested too deeply for the decoder)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"Request body must be a JSON object: {exc}") from None
    except RecursionError:
        raise ApiError(
            400, "invalid_json", "Request body must be a JSON object: nested too deeply"
        ) from None
    if type(value) is not dict:
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number"
        )
        raise ApiError(400, "invalid_json", f"Request body must be a JSON object, got {kind}")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists/objects deeper than ``limit`` (iterative)."""
    if not isinstance(value, dict | list):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children: Any = item.values() if isinstance(item, dict) else item
        # only containers are pushed: a list of 100,000 strings is one pass, not 100,000
        stack.extend([(c, depth + 1) for c in children if isinstance(c, (dict, list))])
    return False


def check_depth(value: Any, param: str) -> None:
    """Refuse ``value`` (400 naming ``param``) when it nests deeper than
    :data:`MAX_TOOL_DEPTH`."""
    if value is not None and _depth_exceeds(value, MAX_TOOL_DEPTH):
        raise invalid_value(param, f"{param} must nest at most {MAX_TOOL_DEPTH} levels deep")


def chat_messages(messages: Sequence[Message], tools: Sequence[Any] | None) -> list[ChatMessage]:
    """The tokenizer's messages of a chat body, once ``tools`` and each message's
    ``tool_calls`` are checked for depth (:func:`check_depth`)."""
    check_depth(tools, "tools")
    out = []
    for i, m in enumerate(messages):
        check_depth(m.tool_calls, f"messages[{i}].tool_calls")
        # content is the text of _content_hook, or None when the key was absent
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        out.append(
            ChatMessage(
                m.role, str(m.content or ""), m.tool_calls, m.name, m.tool_call_id, reasoning
            )
        )
    return out
