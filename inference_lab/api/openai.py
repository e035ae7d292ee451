"""The OpenAI wire format: request validation, prompt-token counting, response bytes.

Pure code (no trio, no quart): the serve app calls it; tests call it directly. What a
request may hold and what each answer looks like is documented in ``docs/``; this module
guarantees the rules below.

Rule 1: HTTP bodies go through one strict cattrs converter (:mod:`inference_lab.validation`):
        unknown keys are ignored (OpenAI clients send many), scalars are never coerced
        (``7.9`` is not an int, ``"false"`` is not a bool, ``true`` is not an int), a
        string with a lone surrogate is refused, and every error names the field path
        (``param``). Validation raises :class:`ApiError`, which carries the full envelope;
        no client input makes a parse function raise anything else.
Rule 2: prompt tokens are counted by the model's :class:`~inference_lab.api.tokenizer.Tokenizer`
        (a real tokenizer: exactly, chat over the rendered messages) or, without one, by
        the byte rule ``ceil(utf8_bytes / 4)`` with 5 % chat template overhead; token-id
        prompts count exactly.
Rule 3: everything about the output is decided at parse time, because the text is known:
        ``stop`` fixes how many tokens are generated (``stop_after``: the token in which the
        first stop string completes, counted as vLLM counts it) and the text returned (cut
        before the stop string); ``n`` choices all carry the same placeholder text;
        logprobs are fixed placeholder values (:func:`logprob_alternatives`).
Rule 4: stream frames are built from bytes pre-encoded once per request (one frame per
        placeholder word and choice), so a token costs a list index, not a ``json.dumps``
        (a completions ``text_offset`` costs one ``int`` to text). A stream sends one frame
        per token and choice; its texts concatenate to the non-streaming text whenever a
        stop string cut it.
Rule 5: every JSON body is compact (:mod:`inference_lab.jsonbytes`) and keeps OpenAI's key
        order; no body ever fails to encode.
"""

from __future__ import annotations

import bisect
import functools
import json
import random
from collections.abc import Sequence
from typing import Any, Literal, NewType

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from inference_lab.api.tokenizer import (
    ByteTokenizer,
    ChatMessage,
    ChatTemplateError,
    Tokenizer,
    default_chat_text,
)
from inference_lab.errors import ApiError, error_body, truncate_echo
from inference_lab.jsonbytes import dumps, dumps_str
from inference_lab.validation import (
    FieldError,
    Invalid,
    check_unicode,
    error_leaves,
    make_strict_converter,
)

__all__ = [
    "BYTE_TOKENIZER",
    "DONE_FRAME",
    "MAX_BODY_BYTES",
    "MAX_CAPACITY",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "VOCABULARY",
    "ApiError",
    "CapacityRequest",
    "DetokenizeRequest",
    "ParsedRequest",
    "StreamEncoder",
    "TokenizeRequest",
    "chat_prompt_text",
    "completion_body",
    "count_chat_tokens",
    "count_text_tokens",
    "detokenize_body",
    "error_body",
    "logprob_alternatives",
    "new_request_id",
    "parse_capacity_request",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_json_object",
    "parse_tokenize_request",
    "placeholder_text",
    "random_hex",
    "stop_point",
    "tokenize_body",
    "truncate_echo",
    "usage",
]

MAX_BODY_BYTES = 2 * 1024 * 1024
#: ``n`` is 1..MAX_N (OpenAI's bound).
MAX_N = 128
#: ``stop`` holds at most this many strings (OpenAI's bound).
MAX_STOP_STRINGS = 4
#: Chat ``top_logprobs`` and completions ``logprobs`` bounds (OpenAI's).
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
#: ``tools`` and ``tool_calls`` may nest at most this deep (they are serialised to count).
MAX_TOOL_DEPTH = 64
#: Upper bound of ``max_num_seqs`` and ``max_waiting`` in a capacity change: far above any
#: replica's batch (and any queue worth holding), far below what overflows a counter.
MAX_CAPACITY = 1_000_000

#: Without a tokenizer file prompts are counted by the byte rule.
BYTE_TOKENIZER: Tokenizer = ByteTokenizer()

#: The placeholder vocabulary: token i of every response is ``VOCABULARY[i % 50] + " "``.
VOCABULARY: tuple[str, ...] = tuple(
    "the of and to in a is that for it was on are be with as at this have from or an by "
    "not but what all were when we there can which their if do will each about how up out "
    "them then she many some so these would".split()
)
assert len(VOCABULARY) == 50
_WORDS: tuple[str, ...] = tuple(f"{w} " for w in VOCABULARY)
_CYCLE = "".join(_WORDS)
_CYCLE_LEN = len(_CYCLE)
#: _ENDS[k]: the offset just past word k within one cycle of the placeholder text.
_ENDS: tuple[int, ...] = tuple(sum(len(w) for w in _WORDS[: k + 1]) for k in range(len(_WORDS)))
_STARTS: tuple[int, ...] = (0, *_ENDS[:-1])


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
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _in_range(lo: int, hi: int | None = None) -> Any:
    """An attrs validator: None, or an int in ``lo..hi``."""
    expected = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"

    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and (value < lo or (hi is not None and value > hi)):
            raise Invalid(expected, value, attr.name)

    return check


def _nonempty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise Invalid("a non-empty array", value, attr.name)


def _expect(text: str) -> dict[str, str]:
    return {"expect": text}


# -- request schemas (only the fields the server uses; the rest are ignored) -------------

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
    name: str | None = None
    tool_call_id: str | None = None


@attrs.frozen(kw_only=True)
class _ChatBody:
    model: str
    messages: list[_Message] = attrs.field(
        validator=_nonempty, metadata=_expect("a non-empty array of messages")
    )
    max_completion_tokens: int | None = attrs.field(
        default=None, validator=_in_range(1), metadata=_expect("an integer >= 1")
    )
    max_tokens: int | None = attrs.field(
        default=None, validator=_in_range(1), metadata=_expect("an integer >= 1")
    )
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    tools: list[Any] | None = None
    priority: int | None = None
    n: int | None = attrs.field(default=None, validator=_in_range(1, MAX_N))
    best_of: int | None = None
    stop: Stop = attrs.field(default=None)
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(
        default=None, validator=_in_range(0, MAX_TOP_LOGPROBS_CHAT)
    )


@attrs.frozen(kw_only=True)
class _CompletionBody:
    model: str
    prompt: Prompt = attrs.field(metadata=_expect(_PROMPT_EXPECT))
    max_tokens: int | None = attrs.field(
        default=None, validator=_in_range(1), metadata=_expect("an integer >= 1")
    )
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    echo: bool | None = None
    priority: int | None = None
    n: int | None = attrs.field(default=None, validator=_in_range(1, MAX_N))
    best_of: int | None = None
    stop: Stop = attrs.field(default=None)
    logprobs: int | None = attrs.field(
        default=None, validator=_in_range(0, MAX_LOGPROBS_COMPLETIONS)
    )


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


def _structure(
    raw: dict[str, Any], cls: type[Any], converter: cattrs.Converter = _CONVERTER
) -> Any:
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


# ---------------------------------------------------------------------------------------
# bodies and token counting


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


def count_text_tokens(text: str) -> int:
    """``ceil(utf8_bytes / 4)``: the prompt-token count of a text without a tokenizer."""
    return BYTE_TOKENIZER.count(text)


def chat_prompt_text(messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None) -> str:
    """The default chat rendering a chat prompt is counted on (see
    :func:`inference_lab.api.tokenizer.default_chat_text`)."""
    return default_chat_text(messages, tools)


def count_chat_tokens(messages: Sequence[Sequence[Any]], tools: Sequence[Any] | None = None) -> int:
    """Chat prompt tokens by the byte rule: the default rendering's count plus 5 %
    template overhead (``raw * 105 // 100``)."""
    return BYTE_TOKENIZER.count_chat(messages, tools)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists/objects deeper than ``limit`` (iterative)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _check_depth(value: Any, param: str) -> None:
    if value is not None and _depth_exceeds(value, MAX_TOOL_DEPTH):
        raise invalid_value(param, f"{param} must nest at most {MAX_TOOL_DEPTH} levels deep")


@attrs.frozen(kw_only=True)
class ParsedRequest:
    """A validated request, normalised for the runtime and the response builders.

    ``prompt_tokens`` is the count usage reports (the engine gets ``max(1, ...)``);
    ``echo_text`` is the prompt text a completions ``echo`` prepends ("" otherwise).
    ``n`` choices share the prompt (usage counts it once) and all carry the same text.
    ``stop_after`` is the number of tokens each choice generates before a stop string
    completes (the engine must stop there; None: no stop string completes within
    ``max_tokens``), and ``stop_chars`` the length of the text then returned (the
    placeholder text cut before the stop string). ``logprobs`` is None when no logprobs
    were asked for, else the number of alternatives per token (chat ``top_logprobs``,
    completions ``logprobs``).
    """

    kind: Literal["chat", "completions"]
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    echo_text: str = ""
    n: int = 1
    stop_after: int | None = None
    stop_chars: int | None = None
    logprobs: int | None = None

    @property
    def output_cap(self) -> int:
        """The most tokens a choice can generate: ``stop_after`` or ``max_tokens``. The
        runtime caps its drawn response length (``target``) with it."""
        return self.stop_after if self.stop_after is not None else self.max_tokens

    def stopped(self, completion_tokens: int) -> bool:
        """Whether a choice of ``completion_tokens`` tokens ended on a stop string."""
        return self.stop_after is not None and completion_tokens >= self.stop_after

    def finish_reason(self, engine_reason: str, completion_tokens: int) -> str:
        """The reported finish reason: ``stop`` when a stop string completed (even in the
        last token ``max_tokens`` allows, as vLLM reports it), else the engine's."""
        return "stop" if self.stopped(completion_tokens) else engine_reason

    def output_text(self, completion_tokens: int) -> str:
        """The text of one choice of ``completion_tokens`` tokens as a non-streaming body
        holds it: cut before the stop string when one completed (verbatim, so streamed
        frames concatenate to it), else the placeholder words with the trailing space
        stripped."""
        if self.stop_after is not None and completion_tokens >= self.stop_after:
            return placeholder_text(self.stop_after)[: self.stop_chars]
        return placeholder_text(completion_tokens).rstrip(" ")


def _check_best_of(best_of: int | None, n: int) -> None:
    if best_of is not None and best_of != n:
        raise ApiError(
            400,
            "unsupported_value",
            f"best_of is not supported: each of the n = {n} choices is generated once "
            f"(best_of must be absent or equal n), got {best_of}",
            "best_of",
        )


def _stop_fields(stops: Any, max_tokens: int) -> dict[str, Any]:
    """ParsedRequest's ``stop_after`` and ``stop_chars`` for the structured ``stop``."""
    point = stop_point(stops, max_tokens) if stops else None
    if point is None:
        return {}
    return {"stop_after": point[0], "stop_chars": point[1]}


def _include_usage(stream: bool, options: _StreamOptions | None) -> bool:
    return stream and options is not None and bool(options.include_usage)


def parse_chat_request(
    raw: dict[str, Any], default_max_tokens: int, *, tokenizer: Tokenizer | None = None
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body and count its prompt with ``tokenizer``
    (None: the byte rule); raises :class:`ApiError` (400)."""
    body: _ChatBody = _structure(raw, _ChatBody)
    n = body.n or 1
    _check_best_of(body.best_of, n)
    if body.top_logprobs and not body.logprobs:
        raise invalid_value(
            "top_logprobs", "top_logprobs needs logprobs set to true, got logprobs: false"
        )
    _check_depth(body.tools, "tools")
    messages = []
    for i, m in enumerate(body.messages):
        _check_depth(m.tool_calls, f"messages[{i}].tool_calls")
        # content is the text of _content_hook, or None when the key was absent
        messages.append(
            ChatMessage(m.role, str(m.content or ""), m.tool_calls, m.name, m.tool_call_id)
        )
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    try:
        prompt_tokens = tok.count_chat(messages, body.tools)
    except ChatTemplateError as exc:
        raise invalid_value("messages", truncate_echo(str(exc))) from None
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    stream = bool(body.stream)
    return ParsedRequest(
        kind="chat",
        model=body.model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_include_usage(stream, body.stream_options),
        priority=body.priority or 0,
        n=n,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        **_stop_fields(body.stop, max_tokens),
    )


def _token_echo(ids: tuple[int, ...]) -> str:
    return "".join(_WORDS[t % len(_WORDS)] for t in ids)


def parse_completion_request(
    raw: dict[str, Any], default_max_tokens: int, *, tokenizer: Tokenizer | None = None
) -> ParsedRequest:
    """Validate a ``/v1/completions`` body and count its prompt with ``tokenizer`` (None:
    the byte rule; token ids count exactly); raises :class:`ApiError` (400)."""
    body: _CompletionBody = _structure(raw, _CompletionBody)
    n = body.n or 1
    _check_best_of(body.best_of, n)
    prompts: tuple[Any, ...] = body.prompt  # type: ignore[assignment]
    if len(prompts) != 1:
        raise ApiError(
            400, "invalid_prompt", f"expected exactly 1 prompt, got {len(prompts)}", "prompt"
        )
    prompt = prompts[0]
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    if isinstance(prompt, str):
        tokens = tok.count(prompt)
        echo_text = prompt
    else:
        tokens = len(prompt)
        if tok.exact:
            try:
                echo_text = tok.decode(prompt)
            except ValueError as exc:
                raise invalid_value("prompt", f"prompt: {exc}") from None
        else:  # the byte rule gives token ids no text: they echo as placeholder words
            echo_text = _token_echo(prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    stream = bool(body.stream)
    return ParsedRequest(
        kind="completions",
        model=body.model,
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_include_usage(stream, body.stream_options),
        priority=body.priority or 0,
        echo_text=echo_text if body.echo else "",
        n=n,
        logprobs=body.logprobs,
        **_stop_fields(body.stop, max_tokens),
    )


@attrs.frozen(kw_only=True)
class CapacityRequest:
    """A ``POST /control/capacity`` body: every key optional, no other key allowed;
    ``model`` None addresses every model. Both limits are at most :data:`MAX_CAPACITY`."""

    model: str | None = None
    max_num_seqs: int | None = attrs.field(default=None, validator=_in_range(1, MAX_CAPACITY))
    max_waiting: int | None = attrs.field(default=None, validator=_in_range(0, MAX_CAPACITY))


def parse_capacity_request(raw: dict[str, Any]) -> CapacityRequest:
    """Validate a capacity change; raises :class:`ApiError` 400 ``invalid_value`` naming
    the field (a bool is not an integer; unknown keys are errors; bounds as documented on
    :class:`CapacityRequest`)."""
    result: CapacityRequest = _structure(raw, CapacityRequest, _STRICT_CONVERTER)
    return result


# ---------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)


@attrs.frozen(kw_only=True)
class _TokenizeBody:
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = attrs.field(
        default=None, metadata=_expect("a non-empty array of messages")
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
    body: _TokenizeBody = _structure(raw, _TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_value("prompt", "send exactly one of prompt (a string) and messages")
    messages = None
    if body.messages is not None:
        if not body.messages:
            raise invalid_value("messages", "messages must be a non-empty array of messages")
        _check_depth(body.tools, "tools")
        for i, m in enumerate(body.messages):
            _check_depth(m.tool_calls, f"messages[{i}].tool_calls")
        messages = tuple(
            ChatMessage(m.role, str(m.content or ""), m.tool_calls, m.name, m.tool_call_id)
            for m in body.messages
        )
    return TokenizeRequest(
        model=body.model,
        prompt=body.prompt,
        messages=messages,
        tools=tuple(body.tools) if body.tools else None,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt is not False,
    )


def tokenize_body(request: TokenizeRequest, tokenizer: Tokenizer, *, max_model_len: int) -> bytes:
    """The ``/tokenize`` answer ``{"count":..,"max_model_len":..,"tokens":[..]}``
    (``count == len(tokens)``). Without a tokenizer file the ids are the byte rule's
    reversible ids; for messages its count is the rendered text's, without the 5 %
    overhead that chat usage adds. Raises ApiError 400 when a chat template refuses the
    messages."""
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
    result: DetokenizeRequest = _structure(raw, DetokenizeRequest)
    for i, token in enumerate(result.tokens):
        if token < 0:
            raise invalid_value(f"tokens[{i}]", f"tokens[{i}] must be an integer >= 0, got {token}")
    return result


def detokenize_body(request: DetokenizeRequest, tokenizer: Tokenizer) -> bytes:
    """The ``/detokenize`` answer ``{"prompt": text}``; 400 ``invalid_value`` (param
    ``tokens``) for an id the tokenizer does not have."""
    try:
        text = tokenizer.decode(request.tokens)
    except ValueError as exc:
        raise invalid_value("tokens", truncate_echo(str(exc))) from None
    return dumps({"prompt": text})


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


def _token_start(index: int) -> int:
    """The offset of token ``index`` (0-based) in the placeholder text."""
    cycles, k = divmod(index, len(_WORDS))
    return cycles * _CYCLE_LEN + _STARTS[k]


def _tokens_ending_by(offset: int) -> int:
    """How many placeholder tokens end at or before text offset ``offset``."""
    cycles, rest = divmod(offset, _CYCLE_LEN)
    return cycles * len(_WORDS) + bisect.bisect_right(_ENDS, rest)


def stop_point(stops: Sequence[str], max_tokens: int) -> tuple[int, int] | None:
    """Where the placeholder text of at most ``max_tokens`` tokens stops, as vLLM stops
    it: ``(tokens, chars)``, the number of tokens generated (the token in which a stop
    string first completes is generated and counted) and the length of the text returned
    (everything before that stop string). When several complete in the same token, the
    text is cut before the one that starts first (vLLM takes the first listed; cutting at
    the earliest start guarantees the text holds no stop string). None when no stop
    string completes within ``max_tokens``.

    The text is periodic, so a stop string's first occurrence, if any, starts in the
    first cycle: one cycle plus the longest stop string is all that is searched."""
    longest = max(len(s) for s in stops)
    count = min(max_tokens, ((_CYCLE_LEN + longest) // _CYCLE_LEN + 1) * len(_WORDS))
    text = placeholder_text(count)
    best: tuple[int, int] | None = None
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        candidate = (_tokens_ending_by(at + len(stop) - 1) + 1, at)
        if best is None or candidate < best:
            best = candidate
    return best


def logprob_alternatives(word: int, top: int) -> list[tuple[str, float]]:
    """The placeholder logprobs of a token that emits ``VOCABULARY[word]``: the emitted
    token first (logprob -0.25), then ``top - 1`` alternatives, the following words of the
    vocabulary, at -2.25, -4.25, ... (probabilities summing to less than 1). At least the
    emitted token is listed."""
    return [
        (_WORDS[(word + rank) % len(_WORDS)], -0.25 - 2.0 * rank) for rank in range(max(top, 1))
    ]


def _chat_logprob_entry(word: int, top: int) -> dict[str, Any]:
    alternatives = logprob_alternatives(word, top)[:top]
    token, logprob = _WORDS[word], -0.25
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives
        ],
    }


def _completion_top(word: int, top: int) -> dict[str, float]:
    return dict(logprob_alternatives(word, top))


def _chat_logprobs(count: int, top: int) -> dict[str, Any]:
    entries = [_chat_logprob_entry(w, top) for w in range(len(_WORDS))]
    return {"content": [entries[i % len(_WORDS)] for i in range(count)]}


def _completion_logprobs(count: int, top: int, offset: int) -> dict[str, Any]:
    tops = [_completion_top(w, top) for w in range(len(_WORDS))]
    n = len(_WORDS)
    return {
        "tokens": [_WORDS[i % n] for i in range(count)],
        "token_logprobs": [-0.25] * count,
        "top_logprobs": [tops[i % n] for i in range(count)],
        "text_offset": [offset + _token_start(i) for i in range(count)],
    }


def random_hex() -> str:
    """32 random hex digits (128 bits), as ``uuid.uuid4().hex`` but a tenth of the cost:
    request ids need only be unique, not secret, so they come from ``random``'s
    generator (seeded from the OS, and again in a forked child) rather than from a read
    of the OS's random source each time."""
    return f"{random.getrandbits(128):032x}"


def new_request_id(kind: Literal["chat", "completions"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{random_hex()}"


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
    """The non-streaming response body. ``completion_tokens`` and ``finish_reason`` are
    one choice's (the engine's ``Finished``); there are ``request.n`` identical choices
    and usage counts ``n * completion_tokens``. The text is :meth:`ParsedRequest.output_text`
    and the finish reason :meth:`ParsedRequest.finish_reason`."""
    text = request.output_text(completion_tokens)
    reason = request.finish_reason(finish_reason, completion_tokens)
    logprobs: dict[str, Any] | None = None
    if request.logprobs is not None:
        if request.kind == "chat":
            logprobs = _chat_logprobs(completion_tokens, request.logprobs)
        else:
            logprobs = _completion_logprobs(
                completion_tokens, request.logprobs, len(request.echo_text)
            )
    head: dict[str, Any] = {"id": request_id}
    choices: list[dict[str, Any]] = []
    if request.kind == "chat":
        head["object"] = "chat.completion"
        for index in range(request.n):
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text},
            }
            if logprobs is not None:
                choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            choices.append(choice)
    else:
        head["object"] = "text_completion"
        for index in range(request.n):
            choice = {"text": request.echo_text + text, "index": index}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            choices.append(choice)
    head["created"] = created
    head["model"] = request.model
    head["choices"] = choices
    head["usage"] = usage(request.prompt_tokens, completion_tokens * request.n)
    return dumps(head)


DONE_FRAME = b"data: [DONE]\n\n"


def _text_tail(kind: str, index: int, text: str) -> bytes:
    """What follows a stream frame's head in a frame of choice ``index`` carrying ``text``
    and no logprobs."""
    if kind == "chat":
        return b'"choices":[{"index":%d,"delta":{"content":' % index + dumps(text) + b"}}]}\n\n"
    return b'"choices":[{"text":' + dumps(text) + b',"index":%d}]}\n\n' % index


@functools.cache
def _plain_tails(kind: str) -> tuple[bytes, ...]:
    """The tails of choice 0's frames of the placeholder words, in word order (built once
    per kind)."""
    return tuple(_text_tail(kind, 0, word) for word in _WORDS)


#: A token frame: complete bytes, or (bytes before, bytes after) a completions
#: ``text_offset`` that depends on the token's position.
_Frame = bytes | tuple[bytes, bytes]


class StreamEncoder:
    """Pre-encoded SSE frames of one streaming response.

    Built once per request; the distinct token frames (one per placeholder word and
    choice) are built on the first token, so a run of tokens costs one index per token
    and choice (:meth:`tokens`). Tokens from the one a stop string cuts onwards have
    their own frames, built with the rest.
    """

    __slots__ = (
        "_head",
        "_request",
        "_frames",
        "_special",
        "_cut",
        "_plain",
        "_plain_until",
        "_last",
    )

    def __init__(self, request: ParsedRequest, *, request_id: str, created: int) -> None:
        self._request = request
        obj = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
        self._head = (
            f'data: {{"id":{dumps_str(request_id)},"object":"{obj}","created":{created},'
            f'"model":{dumps_str(request.model)},'
        ).encode("utf-8", "backslashreplace")
        self._frames: tuple[tuple[_Frame, ...], ...] | None = None
        self._special: dict[int, tuple[_Frame, ...]] = {}
        #: the token (0-based) in which the stop cut falls; None without a stop
        self._cut: int | None = None
        if request.stop_after is not None and request.stop_chars is not None:
            self._cut = _tokens_ending_by(request.stop_chars)
        #: one choice without logprobs: the 50 complete frames (set with the frames),
        #: good for the tokens before ``_plain_until`` (the stop cut)
        self._plain: tuple[bytes, ...] | None = None
        self._plain_until = self._cut if self._cut is not None else 1 << 62
        #: word -> the frames of a stream's last token (no trailing space)
        self._last: dict[int, tuple[_Frame, ...]] = {}

    # -- frame building ------------------------------------------------------------
    def _text_frame(self, index: int, text: str) -> bytes:
        """A frame of choice ``index`` carrying ``text`` and no logprobs."""
        return self._head + _text_tail(self._request.kind, index, text)

    def _frame(self, index: int, text: str, word: int) -> _Frame:
        """The frame of one token of choice ``index`` carrying ``text`` and, when asked
        for, the logprobs of a token emitting ``VOCABULARY[word]``."""
        request = self._request
        top = request.logprobs
        if top is None:
            return self._text_frame(index, text)
        if request.kind == "chat":
            head = self._head + b'"choices":[{"index":%d,"delta":{"content":' % index
            entry = dumps(_chat_logprob_entry(word, top))
            return head + dumps(text) + b'},"logprobs":{"content":[' + entry + b"]}}]}\n\n"
        body = self._head + b'"choices":[{"text":' + dumps(text) + b',"index":%d' % index
        token = _WORDS[word]
        body += (
            b',"logprobs":{"tokens":['
            + dumps(token)
            + b'],"token_logprobs":[-0.25],"top_logprobs":['
            + dumps(_completion_top(word, top))
            + b'],"text_offset":['
        )
        return body, b"]}}]}\n\n"

    def prepare(self) -> None:
        """Build the token frames now rather than on the first token (the completion route
        calls it while the request's prefill runs, off the path of its first token)."""
        self._token_frames()

    def _token_frames(self) -> tuple[tuple[_Frame, ...], ...]:
        frames = self._frames
        if frames is None:
            cut = self._cut
            request = self._request
            if request.n == 1 and request.logprobs is None:
                head = self._head  # the common case: the head + a tail shared by all streams
                self._plain = tuple([head + tail for tail in _plain_tails(request.kind)])
                frames = tuple([(frame,) for frame in self._plain])
            else:
                frames = tuple(
                    tuple(self._frame(c, _WORDS[w], w) for c in range(request.n))
                    for w in range(len(_WORDS))
                )
            self._frames = frames
            if cut is not None and request.stop_after is not None:
                text = placeholder_text(request.stop_after)
                for i in range(cut, request.stop_after):
                    piece = text[_token_start(i) : request.stop_chars] if i == cut else ""
                    w = i % len(_WORDS)
                    self._special[i] = tuple(self._frame(c, piece, w) for c in range(request.n))
        return frames

    # -- the frames ----------------------------------------------------------------
    def opening(self) -> bytes:
        """What is sent at admission: the chat role frame of each choice, or each choice's
        completions echo frame (empty for a completions stream without echo)."""
        n = self._request.n
        if self._request.kind == "chat":
            return b"".join(
                self._head + b'"choices":[{"index":%d,"delta":{"role":"assistant"}}]}\n\n' % c
                for c in range(n)
            )
        if self._request.echo_text:
            text = dumps(self._request.echo_text)
            return b"".join(
                self._head + b'"choices":[{"text":' + text + b',"index":%d}]}\n\n' % c
                for c in range(n)
            )
        return b""

    def tokens(self, start: int, stop: int, *, final: bool = False) -> bytes:
        """The frames of tokens ``start .. stop-1`` (each token: one frame per choice, in
        choice order), joined. ``final``: token ``stop-1`` is the stream's last (it
        finished), so its word goes without the trailing space — the streamed text then
        equals the non-streaming text, which client tokenizers count as exactly
        ``completion_tokens`` tokens."""
        if final and stop > start and (self._cut is None or stop - 1 < self._cut):
            return self.tokens(start, stop - 1) + self._last_frames(stop - 1)
        plain = self._plain
        if plain is not None and stop <= self._plain_until:  # the common case
            return b"".join([plain[i % 50] for i in range(start, stop)])
        frames = self._token_frames()
        size = len(frames)
        request = self._request
        cut = self._cut
        out: list[bytes] = []
        base = len(request.echo_text)
        special = self._special
        for i in range(start, stop):
            row = special.get(i) if cut is not None and i >= cut else None
            if row is None:
                row = frames[i % size]
            for frame in row:
                if isinstance(frame, bytes):
                    out.append(frame)
                else:
                    out.append(frame[0] + b"%d" % (base + _token_start(i)) + frame[1])
        return b"".join(out)

    def _last_frames(self, index: int) -> bytes:
        """The frames of token ``index`` as a stream's last token (see :meth:`tokens`)."""
        word = index % len(_WORDS)
        row = self._last.get(word)
        if row is None:
            text = VOCABULARY[word]
            row = tuple(self._frame(c, text, word) for c in range(self._request.n))
            self._last[word] = row
        base = len(self._request.echo_text)
        return b"".join(
            frame
            if isinstance(frame, bytes)
            else frame[0] + b"%d" % (base + _token_start(index)) + frame[1]
            for frame in row
        )

    def closing(self, finish_reason: str, completion_tokens: int) -> bytes:
        """The finish frame of each choice, the usage frame when asked for, and ``[DONE]``.

        ``finish_reason`` and ``completion_tokens`` are one choice's (the engine's
        ``Finished``): usage counts ``n * completion_tokens``. A stream that a stop string
        would have cut but that ended before the stop string completed first gets the
        text its cut frames held back, so its frames still concatenate to the whole text.
        """
        request = self._request
        n = request.n
        frames = b""
        cut = self._cut
        if cut is not None and not request.stopped(completion_tokens) and completion_tokens > cut:
            held = placeholder_text(completion_tokens)[request.stop_chars :]
            frames += b"".join(self._text_frame(c, held) for c in range(n))
        reason = dumps(request.finish_reason(finish_reason, completion_tokens))
        for c in range(n):
            if request.kind == "chat":
                frames += (
                    self._head
                    + b'"choices":[{"index":%d,"delta":{},"finish_reason":' % c
                    + reason
                    + b"}]}\n\n"
                )
            else:
                frames += (
                    self._head
                    + b'"choices":[{"text":"","index":%d,"finish_reason":' % c
                    + reason
                    + b"}]}\n\n"
                )
        if request.include_usage:
            use = dumps(usage(request.prompt_tokens, completion_tokens * n))
            frames += self._head + b'"choices":[],"usage":' + use + b"}\n\n"
        return frames + DONE_FRAME

    @staticmethod
    def failure(message: str) -> bytes:
        """The frames ending a stream whose engine failed: the error, then ``[DONE]``."""
        body = error_body(message, "server_error", "engine_failed", None)
        return b"data: " + body + b"\n\n" + DONE_FRAME
