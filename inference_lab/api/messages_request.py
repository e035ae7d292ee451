"""The Anthropic Messages API's request: ``POST /v1/messages`` and its ``count_tokens``.

A Messages body is parsed into the values a chat request is (a
:class:`~inference_lab.api.requests.ParsedRequest` for the engine, an
:class:`~inference_lab.api.agents.AgentRequest` for the answer's shape), so the same
engine, pacing, admission and prefix caching serve it; its answer is laid out by
:mod:`inference_lab.api.agents` and written by :mod:`inference_lab.api.messages_encoding`.

Rule 1: the conversation is counted as the chat messages it stands for: ``system`` first,
        each user message's text, each ``tool_result`` block as a ``tool`` message (its
        ``tool_use_id`` as the call id), each assistant message's text with its
        ``tool_use`` blocks as tool calls and its ``thinking`` as earlier reasoning;
        images and documents add nothing, as image parts add nothing to a chat prompt.
Rule 2: every field is validated where it is read and a failure is a 400 naming it
        (``messages[2].content[0].tool_use_id``); a block type the server cannot honour
        (server tools' results, ``container_upload``, ...) and a tool that is not a
        custom (function) tool are 400 ``unsupported_value``.
Rule 3: ``thinking`` on a model with ``[model.reasoning]``: ``enabled`` (or ``adaptive``)
        reasons at the model's default effort (``medium`` where that is ``none``),
        ``disabled`` not at all, absent as the model does by default; other models
        ignore it. ``tool_choice`` ``any`` is chat's ``required``, ``tool`` a named one;
        ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
Rule 4: the work a body asks for is bounded: at most :data:`MAX_STOP_SEQUENCES` stop
        sequences, and the messages and blocks a 2 MiB body can hold.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from inference_lab.api.agent_request import (
    AgentRequest,
    FunctionTool,
    ToolChoice,
    parse_function_tool,
    parse_tool_array,
)
from inference_lab.api.hashing import PromptHashing, hash_chat
from inference_lab.api.requests import BYTE_TOKENIZER, ParsedRequest, session_of
from inference_lab.api.schema import MAX_INT32, check_depth, invalid_value
from inference_lab.api.text import placeholder_text, stop_point
from inference_lab.api.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from inference_lab.api.tool_choice import conversation_turn
from inference_lab.errors import ApiError, truncate_echo
from inference_lab.validation import check_unicode

__all__ = [
    "MAX_STOP_SEQUENCES",
    "MessagesRequest",
    "parse_messages_request",
]

#: The most ``stop_sequences`` a request may give (each is searched in the answer).
MAX_STOP_SEQUENCES = 64
#: Anthropic's least ``thinking.budget_tokens``.
MIN_THINKING_BUDGET = 1024
#: Content blocks that add nothing to the prompt's count (Rule 1).
_SILENT_BLOCKS = frozenset({"image", "document", "search_result", "redacted_thinking"})


@attrs.frozen(kw_only=True)
class MessagesRequest:
    """A validated Messages body."""

    parsed: ParsedRequest
    agent: AgentRequest
    #: The conversation as chat messages (``system`` first), as it was counted.
    messages: tuple[ChatMessage, ...]
    stop_sequences: tuple[str, ...]

    def stop_sequence(self, completion_tokens: int) -> str | None:
        """The stop sequence that ended an answer of ``completion_tokens`` tokens, or
        None (the one that starts where the text was cut)."""
        parsed = self.parsed
        if not parsed.stopped(completion_tokens) or parsed.stop_chars is None:
            return None
        text = placeholder_text(parsed.stop_after or 0)
        cut = parsed.stop_chars
        return next((s for s in self.stop_sequences if text.startswith(s, cut)), None)


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return truncate_echo(text if len(text) <= 60 else text[:57] + "...")


def _string(value: Any, param: str, *, empty: bool = True) -> str:
    if type(value) is not str or not check_unicode(value) or (not empty and not value):
        what = "a string" if empty else "a non-empty string"
        raise invalid_value(param, f"{param} must be {what} of valid Unicode, got {_short(value)}")
    return value


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, "unsupported_value", message, param)


def _block_text(value: Any, param: str) -> str:
    """The text of a ``tool_result``'s ``content`` or of ``system``: a string, or text
    blocks (images add nothing)."""
    if value is None:
        return ""
    if type(value) is str:
        return _string(value, param)
    if type(value) is not list:
        raise invalid_value(param, f"{param} must be a string or an array of content blocks")
    out = []
    for j, block in enumerate(value):
        where = f"{param}[{j}]"
        if type(block) is not dict:
            raise invalid_value(where, f"{where} must be a content block object")
        kind = block.get("type")
        if kind == "text":
            out.append(_string(block.get("text"), f"{where}.text"))
        elif kind not in _SILENT_BLOCKS:
            raise _unsupported(
                f"{where}.type", f"{where}.type: {_short(kind)} is not supported here"
            )
    return "".join(out)


def _user_blocks(content: list[Any], where: str) -> list[ChatMessage]:
    """A user message's blocks: runs of text as user messages, each ``tool_result`` a
    tool message (Rule 1)."""
    out: list[ChatMessage] = []
    text: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if type(block) is not dict:
            raise invalid_value(at, f"{at} must be a content block object")
        kind = block.get("type")
        if kind == "text":
            text.append(_string(block.get("text"), f"{at}.text"))
        elif kind == "tool_result":
            if text:
                out.append(ChatMessage("user", "".join(text)))
                text = []
            call = _string(block.get("tool_use_id"), f"{at}.tool_use_id", empty=False)
            result = _block_text(block.get("content"), f"{at}.content")
            if block.get("is_error") is not None and type(block.get("is_error")) is not bool:
                raise invalid_value(f"{at}.is_error", f"{at}.is_error must be a boolean")
            out.append(ChatMessage("tool", result, None, None, call))
        elif kind == "tool_use":
            raise invalid_value(f"{at}.type", f"{at}: tool_use blocks belong to assistant turns")
        elif kind not in _SILENT_BLOCKS:
            raise _unsupported(
                f"{at}.type", f"{at}.type: blocks of type {_short(kind)} are not supported"
            )
    if text or not out:
        out.append(ChatMessage("user", "".join(text)))
    return out


def _assistant_blocks(content: list[Any], where: str) -> ChatMessage:
    """An assistant message's blocks: its text, its ``tool_use`` blocks as tool calls and
    its ``thinking`` as earlier reasoning (Rule 1)."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if type(block) is not dict:
            raise invalid_value(at, f"{at} must be a content block object")
        kind = block.get("type")
        if kind == "text":
            text.append(_string(block.get("text"), f"{at}.text"))
        elif kind == "tool_use":
            call = _string(block.get("id"), f"{at}.id", empty=False)
            name = _string(block.get("name"), f"{at}.name", empty=False)
            arguments = block.get("input")
            if type(arguments) is not dict:
                raise invalid_value(f"{at}.input", f"{at}.input must be an object")
            check_depth(arguments, f"{at}.input")
            dumped = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
            calls.append(
                {"id": call, "type": "function", "function": {"name": name, "arguments": dumped}}
            )
        elif kind == "thinking":
            reasoning.append(_string(block.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_result":
            raise invalid_value(f"{at}.type", f"{at}: tool_result blocks belong to user turns")
        elif kind not in _SILENT_BLOCKS:
            raise _unsupported(
                f"{at}.type", f"{at}.type: blocks of type {_short(kind)} are not supported"
            )
    return ChatMessage(
        "assistant",
        "".join(text),
        calls or None,
        None,
        None,
        "".join(reasoning) if reasoning else None,
    )


def _conversation(raw: Mapping[str, Any]) -> list[ChatMessage]:
    messages = raw.get("messages")
    if type(messages) is not list or not messages:
        raise invalid_value("messages", "messages must be a non-empty array of messages")
    out: list[ChatMessage] = []
    system = raw.get("system")
    if system is not None:
        text = _block_text(system, "system")
        if text:
            out.append(ChatMessage("system", text))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if type(message) is not dict:
            raise invalid_value(where, f"{where} must be a message object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise invalid_value(
                f"{where}.role", f"{where}.role must be 'user' or 'assistant', got {_short(role)}"
            )
        content = message.get("content")
        if type(content) is str:
            out.append(ChatMessage(role, _string(content, f"{where}.content")))
        elif type(content) is list:
            if role == "user":
                out.extend(_user_blocks(content, where))
            else:
                out.append(_assistant_blocks(content, where))
        else:
            raise invalid_value(
                f"{where}.content",
                f"{where}.content must be a string or an array of content blocks",
            )
    return out


def _tools(value: Any) -> tuple[tuple[FunctionTool, ...], list[dict[str, Any]]]:
    """Custom tools as function tools, and the same in chat form for the chat template."""
    return parse_tool_array(value, _custom_tool)


def _custom_tool(tool: dict[str, Any], where: str) -> tuple[FunctionTool, dict[str, Any]]:
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise _unsupported(
            f"{where}.type",
            f"{where}.type: only custom tools are supported (name, description, "
            f"input_schema), got {_short(kind)}",
        )
    if type(tool.get("input_schema")) is not dict:
        raise invalid_value(
            f"{where}.input_schema", f"{where}.input_schema must be a JSON Schema object"
        )
    parsed = parse_function_tool(
        tool.get("name"),
        tool.get("input_schema"),
        where,
        name_param=f"{where}.name",
        params_param=f"{where}.input_schema",
        description=tool.get("description"),
    )
    function = {"name": parsed.name, "parameters": tool["input_schema"]}
    if type(tool.get("description")) is str:
        function["description"] = tool["description"]
    return parsed, function


def _tool_choice(value: Any, tools: Sequence[FunctionTool]) -> tuple[ToolChoice, str | None, bool]:
    """``tool_choice`` as chat's mode, the named tool and whether calls may be parallel
    (Rule 3)."""
    if value is None:
        return "auto", None, True
    if type(value) is not dict:
        raise invalid_value("tool_choice", "tool_choice must be an object")
    disable = value.get("disable_parallel_tool_use", False)
    if type(disable) is not bool:
        raise invalid_value(
            "tool_choice.disable_parallel_tool_use",
            "tool_choice.disable_parallel_tool_use must be a boolean",
        )
    kind = value.get("type")
    if kind in ("auto", "none"):
        return kind, None, not disable
    if kind in ("any", "tool") and not tools:
        raise invalid_value("tool_choice", f"tool_choice {kind!r} needs tools")
    if kind == "any":
        return "required", None, not disable
    if kind == "tool":
        name = value.get("name")
        if not any(t.name == name for t in tools):
            raise invalid_value(
                "tool_choice.name",
                f"tool_choice names {_short(name)}, which is not among the tools",
            )
        return "function", str(name), not disable
    raise invalid_value(
        "tool_choice.type",
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {_short(kind)}",
    )


def _thinking(value: Any, max_tokens: int | None) -> bool | None:
    """``thinking`` as the chat ``enable_thinking`` switch (Rule 3)."""
    if value is None:
        return None
    if type(value) is not dict:
        raise invalid_value("thinking", "thinking must be an object")
    kind = value.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise invalid_value(
            "thinking.type",
            f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {_short(kind)}",
        )
    budget = value.get("budget_tokens")
    if type(budget) is not int or budget < MIN_THINKING_BUDGET:
        raise invalid_value(
            "thinking.budget_tokens",
            f"thinking.budget_tokens must be an integer >= {MIN_THINKING_BUDGET}, got {_short(budget)}",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise invalid_value(
            "thinking.budget_tokens",
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
        )
    return True


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if (
        type(value) is not list
        or len(value) > MAX_STOP_SEQUENCES
        or not all(type(s) is str and s and check_unicode(s) for s in value)
    ):
        raise invalid_value(
            "stop_sequences",
            f"stop_sequences must be an array of at most {MAX_STOP_SEQUENCES} non-empty strings",
        )
    return tuple(value)


def _int(raw: Mapping[str, Any], key: str, lo: int, required: bool) -> int | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise invalid_value(key, f"{key} is required")
        return None
    if type(value) is not int or not lo <= value <= MAX_INT32:
        raise invalid_value(
            key, f"{key} must be an integer in {lo}..{MAX_INT32}, got {_short(value)}"
        )
    return value


def parse_messages_request(
    raw: Mapping[str, Any],
    *,
    tokenizer: Tokenizer | None = None,
    hashing: PromptHashing | None = None,
    count_only: bool = False,
) -> MessagesRequest:
    """Validate a Messages body and count its prompt (Rules 1-4), hashing it with
    ``hashing`` for prefix caching; ``count_only`` (``/v1/messages/count_tokens``) needs no
    ``max_tokens``. Raises :class:`ApiError` (400)."""
    model = raw.get("model")
    if type(model) is not str or not model:
        raise invalid_value("model", "model is required (a string)")
    max_tokens = _int(raw, "max_tokens", 1, required=not count_only)
    messages = _conversation(raw)
    tools, chat_tools = _tools(raw.get("tools"))
    choice, named, parallel = _tool_choice(raw.get("tool_choice"), tools)
    thinking = _thinking(raw.get("thinking"), max_tokens)
    stops = _stop_sequences(raw.get("stop_sequences"))
    stream = raw.get("stream", False)
    if type(stream) is not bool:
        raise invalid_value("stream", "stream must be a boolean")
    budget = max_tokens or 1
    point = stop_point(stops, budget) if stops else None
    stop: dict[str, Any] = {}
    if point is not None:
        stop = {"stop_after": point[0], "stop_chars": point[1]}
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    hashed: dict[str, Any] = {}
    try:
        if hashing is None or count_only:
            prompt_tokens = tok.count_chat(messages, chat_tools or None)
        else:
            answer, answer_tokens = hashing.answer(
                budget, stop.get("stop_after"), stop.get("stop_chars")
            )
            result = hash_chat(tok, messages, chat_tools or None, answer, answer_tokens, hashing)
            prompt_tokens = result.count
            hashed = {"block_hashes": result.hashes, "hashed_tokens": result.tokens}
    except ChatTemplateError as exc:
        raise invalid_value("messages", truncate_echo(str(exc))) from None
    parsed = ParsedRequest(
        kind="chat",
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=budget,
        stream=stream,
        include_usage=False,
        priority=0,
        session=_session(raw),
        **stop,
        **hashed,
    )
    turn = conversation_turn((m.role, m.content, len(m.tool_calls or ())) for m in messages)
    agent = AgentRequest(
        tools=tools,
        tool_choice=choice,
        named=named,
        parallel_tool_calls=parallel,
        thinking=thinking,
        turn=turn,
    )
    return MessagesRequest(
        parsed=parsed, agent=agent, messages=tuple(messages), stop_sequences=stops
    )


def _session(raw: Mapping[str, Any]) -> int | None:
    """The request's session (``api/requests.py`` Rule 5): Anthropic's
    ``metadata.user_id``."""
    metadata = raw.get("metadata")
    user_id = metadata.get("user_id") if type(metadata) is dict else None
    return session_of((("metadata.user_id", user_id),))
