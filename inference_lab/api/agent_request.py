"""What an agent asks of an answer: tools, ``tool_choice``, structured output, reasoning.

Read here from a chat body (:func:`parse_chat_agent`); the Responses API and the
Messages API build the same :class:`AgentRequest` from their own bodies
(:mod:`inference_lab.api.responses_api`, :mod:`inference_lab.api.messages_api`). What the
answer then is, is :mod:`inference_lab.api.agents`'.

Rule 1: every field is validated where it is read; a failure is a 400 naming the field
        (``tools[2].function.name``, ``response_format.json_schema.schema``).
Rule 2: the conversation's state for ``tool_choice: "auto"`` (:class:`Turn`: a fresh
        question or a tool's result, the calls made since the question) is read from the
        messages as the client sent them (:mod:`inference_lab.api.tool_choice`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from inference_lab.api.schema import check_depth, invalid_value
from inference_lab.api.tool_choice import Turn, conversation_turn, tool_words
from inference_lab.core.config import EFFORTS
from inference_lab.errors import ApiError, truncate_echo

__all__ = [
    "AgentRequest",
    "FunctionTool",
    "StructuredOutput",
    "ToolChoice",
    "chat_turn",
    "message_text",
    "parse_chat_agent",
    "parse_effort",
    "parse_function_tool",
    "parse_tool_array",
    "parse_tool_choice",
]

#: A function name as OpenAI accepts it.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@attrs.frozen(kw_only=True)
class FunctionTool:
    """A function tool: its name and its parameters' JSON Schema (an object schema)."""

    name: str
    parameters: Any
    #: The body field of the schema, for error messages (``tools[2].function.parameters``).
    param: str
    #: The words the tool is known by (``tool_choice.tool_words``): does it fit a question?
    words: frozenset[str] = frozenset()


@attrs.frozen(kw_only=True)
class StructuredOutput:
    """The answer must be a JSON object (``json_object``), an instance of ``schema``
    (``json_schema``), one of ``choices`` (``choice``) or a match of ``pattern``
    (``regex``)."""

    kind: Literal["json_object", "json_schema", "choice", "regex"]
    param: str
    schema: Any = None
    choices: tuple[str, ...] = ()
    pattern: str | None = None


ToolChoice = Literal["none", "auto", "required", "function"]


@attrs.frozen(kw_only=True)
class AgentRequest:
    """The agent-facing options of one request, validated."""

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "auto"
    #: The function a named ``tool_choice`` forces.
    named: str | None = None
    parallel_tool_calls: bool = True
    output: StructuredOutput | None = None
    #: The requested reasoning effort (None: the model's default).
    effort: str | None = None
    #: ``chat_template_kwargs.enable_thinking`` (Qwen3's switch; None: not given).
    thinking: bool | None = None
    #: Where the conversation stands (``tool_choice: "auto"`` reads it, Rule 2).
    turn: Turn = Turn()

    @property
    def plain(self) -> bool:
        """Nothing here changes a prose answer (reasoning aside)."""
        return self.output is None and (not self.tools or self.tool_choice == "none")


def _expect(value: Any, kind: type, param: str, what: str) -> Any:
    if type(value) is not kind:
        raise invalid_value(param, f"{param} must be {what}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return truncate_echo(text if len(text) <= 60 else text[:57] + "...")


def parse_function_tool(
    name: Any,
    parameters: Any,
    param: str,
    *,
    name_param: str,
    params_param: str,
    description: Any = None,
) -> FunctionTool:
    """One function tool (its schema is checked when the answer is planned:
    ``api/agents.py``); ``description`` only says what the tool is for."""
    if type(name) is not str or not TOOL_NAME.fullmatch(name):
        raise invalid_value(
            name_param,
            f"{name_param} must be 1-64 characters a-z, A-Z, 0-9, '_' or '-', got {_short(name)}",
        )
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if type(parameters) is not dict:
        raise invalid_value(params_param, f"{params_param} must be a JSON Schema object")
    declared = parameters.get("type")
    if declared is not None and declared != "object" and declared != ["object"]:
        raise invalid_value(
            params_param,
            f"{params_param} must describe an object (its type is {_short(declared)})",
        )
    words = tool_words({"name": name, "description": description, "parameters": parameters})
    return FunctionTool(
        name=name, parameters=parameters, param=params_param, words=frozenset(words)
    )


def parse_tool_array(
    value: Any, one: Callable[[dict[str, Any], str], tuple[FunctionTool, dict[str, Any]]]
) -> tuple[tuple[FunctionTool, ...], list[dict[str, Any]]]:
    """A Responses or Messages body's ``tools`` (None: none): an array of objects, each
    parsed by ``one(tool, "tools[i]")`` into a function tool and its ``function`` object
    for the chat template; two tools may not share a name."""
    if value is None:
        return (), []
    if type(value) is not list:
        raise invalid_value("tools", "tools must be an array of tools")
    check_depth(value, "tools")
    tools: list[FunctionTool] = []
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if type(tool) is not dict:
            raise invalid_value(where, f"{where} must be a tool object")
        parsed, function = one(tool, where)
        if any(t.name == parsed.name for t in tools):
            raise invalid_value(f"{where}.name", f"two tools are named {parsed.name!r}")
        tools.append(parsed)
        chat.append({"type": "function", "function": function})
    return tuple(tools), chat


def _chat_tools(raw: Mapping[str, Any]) -> tuple[FunctionTool, ...]:
    tools = raw.get("tools")
    if tools is None:
        return ()
    _expect(tools, list, "tools", "an array of tools")
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _expect(tool, dict, where, "a tool object")
        if tool.get("type", "function") != "function":
            raise ApiError(
                400,
                "unsupported_value",
                f"{where}.type: only function tools are supported, got {_short(tool.get('type'))}",
                f"{where}.type",
            )
        function = _expect(tool.get("function"), dict, f"{where}.function", "an object")
        parsed = parse_function_tool(
            function.get("name"),
            function.get("parameters"),
            where,
            name_param=f"{where}.function.name",
            params_param=f"{where}.function.parameters",
            description=function.get("description"),
        )
        if parsed.name in seen:
            raise invalid_value(
                f"{where}.function.name", f"two tools are named {parsed.name!r}: names must differ"
            )
        seen.add(parsed.name)
        out.append(parsed)
    return tuple(out)


def parse_tool_choice(
    value: Any, tools: Sequence[FunctionTool], *, responses: bool = False
) -> tuple[ToolChoice, str | None]:
    """``tool_choice``: a mode string or a named function (chat:
    ``{"type": "function", "function": {"name": ...}}``; Responses:
    ``{"type": "function", "name": ...}``). Without tools, only ``none`` and ``auto``."""
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise invalid_value("tool_choice", "tool_choice 'required' needs tools")
        return value, None
    if type(value) is dict and value.get("type") == "function":
        if responses:
            name = value.get("name")
        else:
            function = value.get("function")
            name = function.get("name") if type(function) is dict else None
        if type(name) is not str:
            raise invalid_value("tool_choice", "a named tool_choice must give the function's name")
        if not any(t.name == name for t in tools):
            raise invalid_value(
                "tool_choice", f"tool_choice names {_short(name)}, which is not among the tools"
            )
        return "function", name
    raise invalid_value(
        "tool_choice",
        f"tool_choice must be 'none', 'auto', 'required' or a named function, got {_short(value)}",
    )


def _schema_value(value: Any, param: str) -> Any:
    """A schema given as an object, or (vLLM's ``guided_json``) as JSON text."""
    if type(value) is str:
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid_value(
                param, f"{param} must be a JSON Schema (object or JSON text)"
            ) from None
    if type(value) is not dict and type(value) is not bool:
        raise invalid_value(param, f"{param} must be a JSON Schema object")
    return value


def _response_format(raw: Mapping[str, Any]) -> StructuredOutput | None:
    value = raw.get("response_format")
    if value is None:
        return None
    _expect(value, dict, "response_format", "an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object", param="response_format")
    if kind == "json_schema":
        spec = _expect(value.get("json_schema"), dict, "response_format.json_schema", "an object")
        schema = spec.get("schema", {"type": "object"})
        param = "response_format.json_schema.schema"
        return StructuredOutput(
            kind="json_schema", param=param, schema=_schema_value(schema, param)
        )
    raise invalid_value(
        "response_format.type",
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
    )


def _guided(raw: Mapping[str, Any]) -> StructuredOutput | None:
    """vLLM's spellings: ``guided_json`` / ``guided_choice`` / ``guided_regex``, and
    ``structured_outputs: {json | json_object | choice | regex}``."""
    found = _guided_params(raw)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f for f, _, _ in found)
        raise invalid_value(
            found[1][0], f"only one structured output may be asked for, got {names}"
        )
    param, kind, value = found[0]
    return _guided_output(param, kind, value)


def _guided_params(raw: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """Every structured output ``raw`` asks for, as (parameter, kind, value), in the order
    ``_guided`` names them in its error."""
    found: list[tuple[str, str, Any]] = []
    for key, kind in (
        ("guided_json", "json"),
        ("guided_choice", "choice"),
        ("guided_regex", "regex"),
    ):
        if raw.get(key) is not None:
            found.append((key, kind, raw[key]))
    spec = raw.get("structured_outputs")
    if spec is not None:
        _expect(spec, dict, "structured_outputs", "an object")
        for key in ("json", "json_object", "choice", "regex", "grammar", "structural_tag"):
            if spec.get(key) is not None:
                found.append((f"structured_outputs.{key}", key, spec[key]))
    if raw.get("guided_grammar") is not None:
        found.append(("guided_grammar", "grammar", raw["guided_grammar"]))
    return found


def _guided_output(param: str, kind: str, value: Any) -> StructuredOutput:
    """The one structured output asked for as ``param`` (its ``kind``), checked."""
    if kind == "json":
        return StructuredOutput(kind="json_schema", param=param, schema=_schema_value(value, param))
    if kind == "json_object":
        if value is not True:
            raise invalid_value(param, f"{param} must be true")
        return StructuredOutput(kind="json_object", param=param)
    if kind == "choice":
        if type(value) is not list or not value or not all(type(c) is str and c for c in value):
            raise invalid_value(param, f"{param} must be a non-empty array of non-empty strings")
        return StructuredOutput(kind="choice", param=param, choices=tuple(value))
    if kind == "regex":
        _expect(value, str, param, "a regular expression")
        return StructuredOutput(kind="regex", param=param, pattern=value)
    raise ApiError(
        400, "unsupported_value", f"{param}: grammars are not supported (use a JSON schema)", param
    )


def parse_effort(value: Any, param: str) -> str | None:
    """A reasoning effort (``none``, ``minimal``, ``low``, ``medium``, ``high``), or None."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise invalid_value(
            param, f"{param} must be one of {', '.join(EFFORTS)}, got {_short(value)}"
        )
    return str(value)


def _thinking(raw: Mapping[str, Any]) -> bool | None:
    kwargs = raw.get("chat_template_kwargs")
    if type(kwargs) is not dict:
        return None
    value = kwargs.get("enable_thinking", kwargs.get("thinking"))
    return value if type(value) is bool else None


def parse_chat_agent(raw: Mapping[str, Any]) -> AgentRequest:
    """The agent options of a ``/v1/chat/completions`` body (the body itself is already
    validated by :func:`~inference_lab.api.requests.parse_chat_request`)."""
    check_depth(raw.get("tools"), "tools")
    tools = _chat_tools(raw)
    choice, named = parse_tool_choice(raw.get("tool_choice"), tools)
    parallel = raw.get("parallel_tool_calls", True)
    _expect(parallel, bool, "parallel_tool_calls", "a boolean")
    output = _response_format(raw)
    guided = _guided(raw)
    if guided is not None:
        if output is not None:
            raise invalid_value(
                guided.param, f"{guided.param} and response_format cannot both be given"
            )
        output = guided
    if output is not None:
        check_depth(output.schema, output.param)
    return AgentRequest(
        tools=tools,
        tool_choice=choice,
        named=named,
        parallel_tool_calls=parallel,
        output=output,
        effort=parse_effort(raw.get("reasoning_effort"), "reasoning_effort"),
        thinking=_thinking(raw),
        turn=chat_turn(raw.get("messages")),
    )


def message_text(content: Any) -> str:
    """The text of a message's ``content`` as the client sent it: a string, or the
    ``text`` of its parts (anything else: "")."""
    if type(content) is str:
        return content
    if type(content) is list:
        return "".join(p["text"] for p in content if type(p) is dict and type(p.get("text")) is str)
    return ""


def chat_turn(messages: Any) -> Turn:
    """The :class:`Turn` of a chat body's ``messages`` (already validated: a list of
    objects with a ``role``)."""
    if type(messages) is not list:
        return Turn()
    return conversation_turn(
        (
            str(m.get("role")),
            message_text(m.get("content")),
            len(m["tool_calls"]) if type(m.get("tool_calls")) is list else 0,
        )
        for m in messages
        if type(m) is dict
    )
