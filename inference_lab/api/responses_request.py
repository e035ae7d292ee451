"""``/v1/responses``: the request, validated and counted as a chat request is.

Rule 1: ``input`` (a string, or message, ``function_call`` and ``function_call_output``
        items), ``instructions`` and the conversation of ``previous_response_id`` are
        counted as chat messages by the model's tokenizer, with the function tools.
Rule 2: fields the server cannot honour (``background``, ``conversation``, ``prompt``)
        are refused with a 400 naming them, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from inference_lab.api.agent_request import parse_tool_array
from inference_lab.api.agents import (
    AgentRequest,
    FunctionTool,
    StructuredOutput,
    parse_effort,
    parse_function_tool,
    parse_tool_choice,
)
from inference_lab.api.requests import BYTE_TOKENIZER, ParsedRequest, session_of
from inference_lab.api.schema import MAX_INT32, check_depth, invalid_value
from inference_lab.api.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from inference_lab.api.tool_choice import conversation_turn
from inference_lab.errors import ApiError, truncate_echo

__all__ = ["ResponsesRequest", "parse_responses_request"]

_ROLES = ("user", "system", "developer", "assistant")
#: Fields refused rather than ignored: the server cannot honour them.
_REFUSED = {
    "background": "background responses are not supported (set background to false)",
    "conversation": "conversations are not supported (use previous_response_id)",
    "prompt": "prompt templates are not supported",
}


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` body."""

    parsed: ParsedRequest
    agent: AgentRequest
    #: The conversation as chat messages (``previous_response_id``'s, then ``input``),
    #: without ``instructions`` (which a follow-up does not inherit).
    messages: tuple[ChatMessage, ...]
    instructions: str | None
    store: bool
    previous_response_id: str | None
    #: Whether the client set ``max_output_tokens`` (Rule 4).
    capped: bool
    #: What the response object echoes of the request.
    echo: Mapping[str, Any]


def _short(value: Any) -> str:
    text = repr(value)
    return truncate_echo(text if len(text) <= 60 else text[:57] + "...")


def _text_of(content: Any, param: str) -> str:
    """A message's text: a string, or the ``text`` of its parts."""
    if content is None:
        return ""
    if type(content) is str:
        return content
    if type(content) is not list:
        raise invalid_value(param, f"{param} must be a string or an array of content parts")
    out = []
    for j, part in enumerate(content):
        if type(part) is not dict:
            raise invalid_value(f"{param}[{j}]", f"{param}[{j}] must be a content part object")
        text = part.get("text")
        if text is not None:
            if type(text) is not str:
                raise invalid_value(f"{param}[{j}].text", f"{param}[{j}].text must be a string")
            out.append(text)
    return "".join(out)


def _input_messages(value: Any) -> list[ChatMessage]:
    if type(value) is str:
        return [ChatMessage("user", value)]
    if type(value) is not list:
        raise invalid_value("input", "input must be a string or an array of input items")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        message = _input_item(item, f"input[{i}]")
        if message is not None:
            out.append(message)
    if not out:
        raise invalid_value("input", "input must hold at least one message")
    return out


def _input_item(item: Any, where: str) -> ChatMessage | None:
    """One input item as the chat message it stands for (None: a reasoning item, which is
    not part of the prompt)."""
    if type(item) is not dict:
        raise invalid_value(where, f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid_value(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}")
        return ChatMessage(str(role), _text_of(item.get("content"), f"{where}.content"))
    if kind == "function_call":
        name, arguments, cid = item.get("name"), item.get("arguments"), item.get("call_id")
        if type(name) is not str or type(arguments) is not str or type(cid) is not str:
            raise invalid_value(
                where, f"{where}: a function_call needs name, arguments and call_id strings"
            )
        call = {
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        return ChatMessage("assistant", "", [call])
    if kind == "function_call_output":
        cid = item.get("call_id")
        if type(cid) is not str:
            raise invalid_value(f"{where}.call_id", f"{where}.call_id must be a string")
        text = _text_of(item.get("output"), f"{where}.output")
        return ChatMessage("tool", text, None, None, cid)
    if kind == "reasoning":
        return None  # a previous answer's reasoning is not part of the prompt
    raise ApiError(
        400,
        "unsupported_value",
        f"{where}.type: input items of type {_short(kind)} are not supported "
        "(message, function_call, function_call_output, reasoning)",
        f"{where}.type",
    )


def _tools(value: Any) -> tuple[tuple[FunctionTool, ...], list[dict[str, Any]]]:
    """The function tools, and the same in chat form for the chat template."""
    return parse_tool_array(value, _function_tool)


def _function_tool(tool: dict[str, Any], where: str) -> tuple[FunctionTool, dict[str, Any]]:
    if tool.get("type") != "function":
        raise ApiError(
            400,
            "unsupported_value",
            f"{where}.type: only function tools are supported, got {_short(tool.get('type'))}",
            f"{where}.type",
        )
    parsed = parse_function_tool(
        tool.get("name"),
        tool.get("parameters"),
        where,
        name_param=f"{where}.name",
        params_param=f"{where}.parameters",
        description=tool.get("description"),
    )
    return parsed, {k: tool[k] for k in ("name", "description", "parameters") if k in tool}


def _text_format(value: Any) -> tuple[StructuredOutput | None, dict[str, Any]]:
    """``text.format`` as a structured output, and the ``text`` the response echoes."""
    if value is None:
        return None, {"format": {"type": "text"}}
    if type(value) is not dict:
        raise invalid_value("text", "text must be an object")
    fmt = value.get("format")
    if fmt is None:
        return None, {**value, "format": {"type": "text"}}
    if type(fmt) is not dict:
        raise invalid_value("text.format", "text.format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None, value
    if kind == "json_object":
        return StructuredOutput(kind="json_object", param="text.format"), value
    if kind == "json_schema":
        schema = fmt.get("schema")
        if type(schema) is not dict:
            raise invalid_value("text.format.schema", "text.format.schema must be a JSON Schema")
        check_depth(schema, "text.format.schema")
        output = StructuredOutput(kind="json_schema", param="text.format.schema", schema=schema)
        return output, value
    raise invalid_value(
        "text.format.type",
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
    )


def _int_field(raw: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise invalid_value(key, f"{key} must be an integer in {lo}..{hi}, got {_short(value)}")
    return value


def _echo(
    raw: Mapping[str, Any],
    instructions: str | None,
    max_output: int | None,
    parallel: bool,
    text_echo: dict[str, Any],
    effort: str | None,
) -> dict[str, Any]:
    """What the response object echoes of the request (the client's values or the API's
    defaults)."""
    tool_choice_echo: Any = raw.get("tool_choice", "auto")
    return {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": raw.get("metadata") if type(raw.get("metadata")) is dict else {},
        "parallel_tool_calls": parallel,
        "temperature": raw.get("temperature", 1.0),
        "text": text_echo,
        "tool_choice": tool_choice_echo,
        "tools": raw.get("tools") or [],
        "top_p": raw.get("top_p", 1.0),
        "truncation": raw.get("truncation", "disabled"),
        "user": raw.get("user"),
        "effort": effort,
    }


def parse_responses_request(
    raw: Mapping[str, Any],
    default_max_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    history: Sequence[ChatMessage] = (),
) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body and count its prompt (Rule 1); ``history`` is the
    conversation of its ``previous_response_id`` (looked up by the caller). Raises
    :class:`ApiError` (400)."""
    for key, message in _REFUSED.items():
        if raw.get(key) not in (None, False):
            raise ApiError(400, "unsupported_value", message, key)
    model = raw.get("model")
    if type(model) is not str:
        raise invalid_value("model", "model is required (a string)")
    if "input" not in raw:
        raise invalid_value("input", "input is required")
    messages = [*history, *_input_messages(raw["input"])]
    instructions = raw.get("instructions")
    if instructions is not None and type(instructions) is not str:
        raise invalid_value("instructions", "instructions must be a string")
    tools, chat_tools = _tools(raw.get("tools"))
    choice, named = parse_tool_choice(raw.get("tool_choice"), tools, responses=True)
    parallel = raw.get("parallel_tool_calls", True)
    if type(parallel) is not bool:
        raise invalid_value("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    output, text_echo = _text_format(raw.get("text"))
    reasoning = raw.get("reasoning")
    if reasoning is not None and type(reasoning) is not dict:
        raise invalid_value("reasoning", "reasoning must be an object")
    effort = parse_effort((reasoning or {}).get("effort"), "reasoning.effort")
    max_output = _int_field(raw, "max_output_tokens", 1, MAX_INT32)
    priority = _int_field(raw, "priority", -MAX_INT32, MAX_INT32) or 0
    stream = raw.get("stream", False)
    store = raw.get("store", True)
    for key, value in (("stream", stream), ("store", store)):
        if type(value) is not bool:
            raise invalid_value(key, f"{key} must be a boolean")
    previous = raw.get("previous_response_id")
    if previous is not None and type(previous) is not str:
        raise invalid_value("previous_response_id", "previous_response_id must be a string")
    prompt = [*([ChatMessage("system", instructions)] if instructions else []), *messages]
    tok = tokenizer if tokenizer is not None else BYTE_TOKENIZER
    try:
        prompt_tokens = tok.count_chat(prompt, chat_tools or None)
    except ChatTemplateError as exc:
        raise invalid_value("input", truncate_echo(str(exc))) from None
    parsed = ParsedRequest(
        kind="chat",
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_output if max_output is not None else default_max_tokens,
        stream=stream,
        include_usage=False,
        priority=priority,
        session=session_of(
            (("prompt_cache_key", raw.get("prompt_cache_key")), ("user", raw.get("user")))
        ),
    )
    agent = AgentRequest(
        tools=tools,
        tool_choice=choice,
        named=named,
        parallel_tool_calls=parallel,
        output=output,
        effort=effort,
        turn=conversation_turn((m.role, m.content, len(m.tool_calls or ())) for m in messages),
    )
    echo = _echo(raw, instructions, max_output, parallel, text_echo, effort)
    return ResponsesRequest(
        parsed=parsed,
        agent=agent,
        messages=tuple(messages),
        instructions=instructions,
        store=store,
        previous_response_id=previous,
        capped=max_output is not None,
        echo=echo,
    )
