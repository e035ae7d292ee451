"""The OpenAI wire format: request validation, prompt-token counting, response bytes.

Pure code (no trio, no quart): the serve app calls it; tests call it directly.
Specified by ``spec/serve-api.md``.

Rule 1: HTTP bodies go through one strict cattrs converter: unknown keys are ignored (OpenAI
        clients send many), scalars are never coerced (``7.9`` is not an int, ``"false"``
        is not a bool, ``true`` is not an int) and every error names the field path
        (``param``). Validation raises :class:`ApiError`, which carries the full envelope.
Rule 2: prompt tokens are counted without a tokenizer: ``ceil(utf8_bytes / 4)``; chat adds
        5 % template overhead (``raw * 105 // 100``); token-id prompts count exactly.
Rule 3: stream frames are built from bytes pre-encoded once per request (a prefix and a
        suffix around each placeholder word), so a token costs a list append, not a
        ``json.dumps``.
Rule 4: every JSON body is compact (``separators=(",", ":")``) and keeps the key order of
        the spec.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Literal, NewType

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from inference_lab.errors import ApiError, error_body

__all__ = [
    "MAX_BODY_BYTES",
    "VOCABULARY",
    "ApiError",
    "CapacityRequest",
    "ParsedRequest",
    "StreamEncoder",
    "chat_prompt_text",
    "count_chat_tokens",
    "count_text_tokens",
    "error_body",
    "parse_capacity_request",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_object",
    "placeholder_text",
]

MAX_BODY_BYTES = 2 * 1024 * 1024

#: The placeholder vocabulary: token i of every response is ``VOCABULARY[i % 50] + " "``.
VOCABULARY: tuple[str, ...] = tuple(
    "the of and to in a is that for it was on are be with as at this have from or an by "
    "not but what all were when we there can which their if do will each about how up out "
    "them then she many some so these would".split()
)
assert len(VOCABULARY) == 50
_WORDS: tuple[str, ...] = tuple(f"{w} " for w in VOCABULARY)
# The words are plain ASCII letters, so their JSON string form is the word itself.
_WORD_BYTES: tuple[bytes, ...] = tuple(w.encode("ascii") for w in _WORDS)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _sorted_dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


# ---------------------------------------------------------------------------------------
# errors


def invalid_value(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_value", message, param)


def _render(value: Any) -> str:
    """A short JSON rendering of a bad value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Invalid(ValueError):
    """A hook's or validator's complaint: the value is not ``expected``. The walker below
    adds the field path (and the field's own ``expect`` text when it has one)."""

    def __init__(self, expected: str, value: Any, field: str | None = None) -> None:
        super().__init__(f"must be {expected}, got {_render(value)}")
        self.expected = expected
        self.value = value
        self.field = field


class _PromptCount(ValueError):
    """A completions prompt that holds other than exactly one prompt."""

    def __init__(self, count: int) -> None:
        super().__init__(f"expected exactly 1 prompt, got {count}")
        self.count = count


# ---------------------------------------------------------------------------------------
# the strict converter for HTTP bodies


def _strict_int(value: Any, _type: Any) -> int:
    if type(value) is not int:
        raise _Invalid("an integer", value)
    return value


def _strict_bool(value: Any, _type: Any) -> bool:
    if type(value) is not bool:
        raise _Invalid("a boolean", value)
    return value


def _strict_str(value: Any, _type: Any) -> str:
    if type(value) is not str:
        raise _Invalid("a string", value)
    return value


def _strict_float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid("a number", value)
    return float(value)


def _is_list(type_: Any) -> bool:
    return getattr(type_, "__origin__", None) is list


def _strict_list_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner = list_structure_factory(type_, converter)

    def structure(value: Any, _type: Any) -> Any:
        if type(value) is not list:
            raise _Invalid("an array", value)
        return inner(value, type_)

    return structure


def _strict_class_factory(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner = make_dict_structure_fn(type_, converter)

    def structure(value: Any, _type: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid("an object", value)
        return inner(value, type_)

    return structure


def _ge_one(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value < 1:
        raise _Invalid("an integer >= 1", value, attr.name)


def _nonempty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise _Invalid("a non-empty array", value, attr.name)


def _expect(text: str) -> dict[str, str]:
    return {"expect": text}


# -- request schemas (only the fields the server uses; the rest are ignored) -------------

Content = NewType("Content", object)  # str | list[part] | None, checked by _content_hook
Prompt = NewType("Prompt", object)  # the four completions prompt forms, see _prompt_hook


@attrs.frozen(kw_only=True)
class _ContentPart:
    text: str | None = None


@attrs.frozen(kw_only=True)
class _StreamOptions:
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class _Message:
    role: str
    content: Content = attrs.field(
        default=None,
        metadata=_expect("a string, an array of content parts, or null"),
    )
    tool_calls: list[Any] | None = None


@attrs.frozen(kw_only=True)
class _ChatBody:
    model: str
    messages: list[_Message] = attrs.field(
        validator=_nonempty, metadata=_expect("a non-empty array of messages")
    )
    max_completion_tokens: int | None = attrs.field(
        default=None, validator=_ge_one, metadata=_expect("an integer >= 1")
    )
    max_tokens: int | None = attrs.field(
        default=None, validator=_ge_one, metadata=_expect("an integer >= 1")
    )
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    tools: list[Any] | None = None
    priority: int | None = None
    n: int | None = None


@attrs.frozen(kw_only=True)
class _CompletionBody:
    model: str
    prompt: Prompt = attrs.field(
        metadata=_expect(
            "a string, an array of strings, an array of token ids or an array of token-id arrays"
        )
    )
    max_tokens: int | None = attrs.field(
        default=None, validator=_ge_one, metadata=_expect("an integer >= 1")
    )
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    echo: bool | None = None
    priority: int | None = None
    n: int | None = None


_PROMPT_EXPECT = (
    "a string, an array of strings, an array of token ids or an array of token-id arrays"
)


def _is_token_ids(value: Any) -> bool:
    return type(value) is list and all(type(t) is int and t >= 0 for t in value)


def _prompt_hook(value: Any, _type: Any) -> Any:
    """One of ``str``, ``[str, ...]``, ``[int, ...]``, ``[[int, ...], ...]``; returns a
    tuple of prompts (each ``str`` or ``tuple[int, ...]``). The count is checked later."""
    if type(value) is str:
        return (value,)
    if type(value) is not list:
        raise _Invalid(_PROMPT_EXPECT, value)
    if not value:
        return ()
    if all(type(p) is str for p in value):
        return tuple(value)
    if _is_token_ids(value):
        return (tuple(value),)
    if all(_is_token_ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    raise _Invalid(_PROMPT_EXPECT, value)


def _content_hook(value: Any, _type: Any) -> Any:
    """Message content: a string, null, or an array of parts whose ``text`` fields are
    concatenated (parts without text, e.g. images, add nothing). Returns the text."""
    if value is None:
        return ""
    if type(value) is str:
        return value
    if type(value) is list:
        parts = _CONVERTER.structure(value, list[_ContentPart])
        return "".join(p.text for p in parts if p.text is not None)
    raise _Invalid("a string, an array of content parts, or null", value)


def _make_converter(forbid_extra_keys: bool) -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=forbid_extra_keys, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(Content, _content_hook)
    conv.register_structure_hook(Prompt, _prompt_hook)
    conv.register_structure_hook_factory(_is_list, _strict_list_factory)
    conv.register_structure_hook_factory(attrs.has, _strict_class_factory)
    return conv


_CONVERTER = _make_converter(forbid_extra_keys=False)  # request bodies: extra keys ignored
_STRICT_CONVERTER = _make_converter(forbid_extra_keys=True)  # control bodies: none allowed


def _first_error(
    exc: BaseException, path: str, cls: type[Any] | None, field: str | None
) -> tuple[str, BaseException, dict[str, Any]]:
    """Walk a cattrs error tree to its first leaf: (field path, leaf error, metadata of
    the innermost attrs field on the path)."""
    meta: dict[str, Any] = {}
    if cls is not None and field is not None and attrs.has(cls):
        found = attrs.fields_dict(cls).get(field)
        if found is not None:
            meta = dict(found.metadata)
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                sub_path = f"{path}.{note.name}" if path else note.name
                return _first_error(sub, sub_path, exc.cl, note.name)
        if without:
            return _first_error(without[0], path, cls, field)
    if isinstance(exc, IterableValidationError):
        indexed, unindexed = exc.group_exceptions()
        for sub, inote in indexed:
            if isinstance(inote, IterableValidationNote):
                elem_cls = inote.type if isinstance(inote.type, type) else None
                return _first_error(sub, f"{path}[{inote.index}]", elem_cls, None)
        if unindexed:
            return _first_error(unindexed[0], path, cls, field)
    if isinstance(exc, _Invalid) and exc.field is not None:
        # An attrs validator: it names its own field within ``cls``.
        sub_path = f"{path}.{exc.field}" if path else exc.field
        if cls is not None and attrs.has(cls):
            found = attrs.fields_dict(cls).get(exc.field)
            meta = dict(found.metadata) if found is not None else {}
        return sub_path, exc, meta
    return path, exc, meta


def _structure(
    raw: dict[str, Any], cls: type[Any], converter: cattrs.Converter = _CONVERTER
) -> Any:
    try:
        return converter.structure(raw, cls)
    except Exception as exc:  # noqa: BLE001 - every structuring failure becomes an ApiError
        path, leaf, meta = _first_error(exc, "", cls, None)
        if isinstance(leaf, ForbiddenExtraKeysError):
            key = sorted(leaf.extra_fields)[0]
            allowed = ", ".join(a.name for a in attrs.fields(cls))
            raise invalid_value(key, f"unknown field '{key}' (allowed: {allowed})") from None
        if isinstance(leaf, KeyError):
            raise invalid_value(path, f"{path} is required") from None
        if isinstance(leaf, _Invalid):
            expected = meta.get("expect", leaf.expected)
            message = f"{path} must be {expected}, got {_render(leaf.value)}"
            raise invalid_value(path, message) from None
        raise invalid_value(path or "body", f"{path or 'body'}: {leaf}") from None


# ---------------------------------------------------------------------------------------
# bodies and token counting


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object (400 ``invalid_json`` else)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"Request body must be a JSON object: {exc}") from None
    if type(value) is not dict:
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number"
        )
        raise ApiError(400, "invalid_json", f"Request body must be a JSON object, got {kind}")
    return value


def count_text_tokens(text: str) -> int:
    """``ceil(utf8_bytes / 4)``: the prompt-token count of a text without a tokenizer."""
    return -(-len(text.encode("utf-8")) // 4)


def chat_prompt_text(
    messages: list[tuple[str, str, list[Any] | None]], tools: list[Any] | None
) -> str:
    """The text a chat prompt is counted on: ``tools: <JSON>`` (if any tools), then one
    ``<role>: <content>`` line per message (tool calls appended as compact sorted JSON,
    after a newline when the content is not empty), joined with newlines."""
    lines: list[str] = []
    if tools:
        lines.append(f"tools: {_sorted_dumps(tools)}")
    for role, content, tool_calls in messages:
        text = content
        if tool_calls:
            calls = _sorted_dumps(tool_calls)
            text = f"{text}\n{calls}" if text else calls
        lines.append(f"{role}: {text}")
    return "\n".join(lines)


def count_chat_tokens(
    messages: list[tuple[str, str, list[Any] | None]], tools: list[Any] | None
) -> int:
    """Chat prompt tokens: the text of :func:`chat_prompt_text`, plus 5 % template
    overhead (``raw * 105 // 100``)."""
    raw = count_text_tokens(chat_prompt_text(messages, tools))
    return raw * 105 // 100


@attrs.frozen(kw_only=True)
class ParsedRequest:
    """A validated request, normalised for the runtime and the response builders.

    ``prompt_tokens`` is the count usage reports (the engine gets ``max(1, ...)``);
    ``echo_text`` is the prompt text a completions ``echo`` prepends ("" otherwise).
    """

    kind: Literal["chat", "completions"]
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    echo_text: str = ""


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise ApiError(400, "unsupported_value", "n > 1 is not supported", "n")


def parse_chat_request(raw: dict[str, Any], default_max_tokens: int) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body; raises :class:`ApiError` (400)."""
    body: _ChatBody = _structure(raw, _ChatBody)
    _check_n(body.n)
    # content is the text of _content_hook, or None when the key was absent
    messages = [(m.role, str(m.content or ""), m.tool_calls) for m in body.messages]
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    stream = bool(body.stream)
    return ParsedRequest(
        kind="chat",
        model=body.model,
        prompt_tokens=count_chat_tokens(messages, body.tools),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream
        and body.stream_options is not None
        and bool(body.stream_options.include_usage),
        priority=body.priority or 0,
    )


def _token_echo(ids: tuple[int, ...]) -> str:
    return "".join(_WORDS[t % len(_WORDS)] for t in ids)


def parse_completion_request(raw: dict[str, Any], default_max_tokens: int) -> ParsedRequest:
    """Validate a ``/v1/completions`` body; raises :class:`ApiError` (400)."""
    body: _CompletionBody = _structure(raw, _CompletionBody)
    _check_n(body.n)
    prompts: tuple[Any, ...] = body.prompt  # type: ignore[assignment]
    if len(prompts) != 1:
        raise ApiError(
            400, "invalid_prompt", f"expected exactly 1 prompt, got {len(prompts)}", "prompt"
        )
    prompt = prompts[0]
    if isinstance(prompt, str):
        tokens = count_text_tokens(prompt)
        echo_text = prompt
    else:
        tokens = len(prompt)
        echo_text = _token_echo(prompt)
    stream = bool(body.stream)
    return ParsedRequest(
        kind="completions",
        model=body.model,
        prompt_tokens=tokens,
        max_tokens=body.max_tokens if body.max_tokens is not None else default_max_tokens,
        stream=stream,
        include_usage=stream
        and body.stream_options is not None
        and bool(body.stream_options.include_usage),
        priority=body.priority or 0,
        echo_text=echo_text if body.echo else "",
    )


def _ge_zero(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value < 0:
        raise _Invalid("an integer >= 0", value, attr.name)


@attrs.frozen(kw_only=True)
class CapacityRequest:
    """A ``POST /control/capacity`` body (``saturation.md``): every key optional, no
    other key allowed; ``model`` None addresses every model."""

    model: str | None = None
    max_num_seqs: int | None = attrs.field(
        default=None, validator=_ge_one, metadata=_expect("an integer >= 1")
    )
    max_waiting: int | None = attrs.field(
        default=None, validator=_ge_zero, metadata=_expect("an integer >= 0")
    )


def parse_capacity_request(raw: dict[str, Any]) -> CapacityRequest:
    """Validate a capacity change; raises :class:`ApiError` 400 ``invalid_value`` naming
    the field (a bool is not an integer; unknown keys are errors)."""
    result: CapacityRequest = _structure(raw, CapacityRequest, _STRICT_CONVERTER)
    return result


# ---------------------------------------------------------------------------------------
# responses


def placeholder_text(count: int, start: int = 0) -> str:
    """The text of tokens ``start .. start+count-1``: one word plus a space each."""
    if count <= 0:
        return ""
    offset = start % len(_WORDS)
    words = _WORDS[offset:] + _WORDS[:offset]
    full, rest = divmod(count, len(_WORDS))
    return "".join(words) * full + "".join(words[:rest])


def new_request_id(kind: Literal["chat", "completions"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request: ParsedRequest,
    *,
    request_id: str,
    created: int,
    completion_tokens: int,
    finish_reason: str,
) -> bytes:
    """The non-streaming response body (text with its trailing space stripped)."""
    text = placeholder_text(completion_tokens).rstrip(" ")
    head: dict[str, Any] = {"id": request_id}
    if request.kind == "chat":
        head["object"] = "chat.completion"
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
    else:
        head["object"] = "text_completion"
        choice = {"text": request.echo_text + text, "index": 0, "finish_reason": finish_reason}
    head["created"] = created
    head["model"] = request.model
    head["choices"] = [choice]
    head["usage"] = usage(request.prompt_tokens, completion_tokens)
    return _dumps(head).encode()


DONE_FRAME = b"data: [DONE]\n\n"


class StreamEncoder:
    """Pre-encoded SSE frames of one streaming response (``serve-api.md``, Streaming).

    Built once per request; the 50 distinct token frames are joined on the first token,
    so a run of tokens costs one index per token (:meth:`tokens`, :meth:`append_tokens`).
    """

    __slots__ = ("_head", "_prefix", "_suffix", "_kind", "_request", "_frames")

    def __init__(self, request: ParsedRequest, *, request_id: str, created: int) -> None:
        self._request = request
        self._kind = request.kind
        obj = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
        head = (
            f'data: {{"id":{_dumps(request_id)},"object":"{obj}","created":{created},'
            f'"model":{_dumps(request.model)},'
        ).encode()
        self._head = head
        if request.kind == "chat":
            self._prefix = head + b'"choices":[{"index":0,"delta":{"content":"'
            self._suffix = b'"}}]}\n\n'
        else:
            self._prefix = head + b'"choices":[{"text":"'
            self._suffix = b'","index":0}]}\n\n'
        self._frames: tuple[bytes, ...] | None = None

    def opening(self) -> bytes:
        """What is sent at admission: the chat role frame, or the completions echo frame
        (empty for a completions stream without echo)."""
        if self._kind == "chat":
            return self._head + b'"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
        if self._request.echo_text:
            text = _dumps(self._request.echo_text).encode()
            return self._head + b'"choices":[{"text":' + text + b',"index":0}]}\n\n'
        return b""

    def _token_frames(self) -> tuple[bytes, ...]:
        frames = self._frames
        if frames is None:
            prefix, suffix = self._prefix, self._suffix
            frames = self._frames = tuple(prefix + word + suffix for word in _WORD_BYTES)
        return frames

    def append_tokens(self, out: list[bytes], start: int, count: int) -> None:
        """Append the frames of tokens ``start .. start+count-1`` to ``out``."""
        frames = self._token_frames()
        n = len(frames)
        out.extend([frames[i % n] for i in range(start, start + count)])

    def tokens(self, start: int, stop: int) -> bytes:
        """The frames of tokens ``start .. stop-1``, joined."""
        frames = self._token_frames()
        n = len(frames)
        return b"".join([frames[i % n] for i in range(start, stop)])

    def closing(self, finish_reason: str, completion_tokens: int) -> bytes:
        """The finish frame, the usage frame when asked for, and ``[DONE]``."""
        reason = _dumps(finish_reason).encode()
        if self._kind == "chat":
            frames = self._head + b'"choices":[{"index":0,"delta":{},"finish_reason":' + reason
            frames += b"}]}\n\n"
        else:
            frames = self._head + b'"choices":[{"text":"","index":0,"finish_reason":' + reason
            frames += b"}]}\n\n"
        if self._request.include_usage:
            use = _dumps(usage(self._request.prompt_tokens, completion_tokens)).encode()
            frames += self._head + b'"choices":[],"usage":' + use + b"}\n\n"
        return frames + DONE_FRAME

    @staticmethod
    def failure(message: str) -> bytes:
        """The frames ending a stream whose engine failed: the error, then ``[DONE]``."""
        body = error_body(message, "server_error", "engine_failed", None)
        return b"data: " + body + b"\n\n" + DONE_FRAME
