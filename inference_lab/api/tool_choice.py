"""Whether a ``tool_choice: "auto"`` answer calls a tool: the conversation decides.

An agent loop sends the conversation so far each turn. A model calls a tool when a fresh
question needs one, reads the result and usually answers; it rarely calls again right
after a result, and less so the more it has called. :func:`call_probability` gives that
chance from where the conversation stands (:class:`Turn`); the draw itself is the
request's own seeded generator (``api/agents.py``), so it is a function of the request.

Rule 1: on a fresh user turn the chance is ``base`` (``--tool-call-probability``) when a
        tool fits the question (:func:`tools_fit`), ``base x NO_FIT`` otherwise.
Rule 2: right after a tool result it is ``base x AFTER_TOOL x DECAY^(k - 1)``, ``k`` the
        tool calls the assistant made since the last user message (at least 1).
Rule 3: a tool fits a question when a content word of the question (3+ letters, not a
        stop word) and a word of the tool's name, description or parameter names agree
        on their first 4 letters (whole words when shorter): ``weather`` fits
        ``get_weather``, ``recipes`` fits ``search_recipe``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import attrs

__all__ = [
    "AFTER_TOOL",
    "DECAY",
    "NO_FIT",
    "Turn",
    "call_probability",
    "conversation_turn",
    "tools_fit",
    "tool_words",
]

#: The share of ``base`` on a fresh user turn that no tool fits (Rule 1).
NO_FIT = 0.25
#: The share of ``base`` right after the first tool result of a turn (Rule 2) ...
AFTER_TOOL = 0.4
#: ... and the factor for each further call the turn has made.
DECAY = 0.5

#: Words that say nothing about what a tool is for (English function words and the verbs
#: tool names start with).
_STOP = frozenset(
    """the and for with from that this what which when where who how are was were can
    you your our their there here into onto about please tell give show make let get set
    list find use using call run any all some one two not but have has had will would
    could should may might must does did done its his her them they then than also just
    only very more most much many such each other""".split()
)
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Za-z][a-z]*|[0-9]+")


def _words(text: str) -> set[str]:
    """The content words of ``text`` (camelCase and snake_case split), lower-cased."""
    return {w.lower() for w in _WORD.findall(text) if len(w) >= 3} - _STOP


def _key(word: str) -> str:
    return word[:4]


def tool_words(tool: Mapping[str, Any]) -> set[str]:
    """The words a tool is known by: its name, description and parameters' names and
    descriptions (a chat ``function`` object or a Responses / Anthropic tool)."""
    parts = [str(tool.get("name") or ""), str(tool.get("description") or "")]
    schema = tool.get("parameters", tool.get("input_schema"))
    if isinstance(schema, dict):
        properties = schema.get("properties")
        if isinstance(properties, dict):
            for name, spec in list(properties.items())[:64]:
                parts.append(str(name))
                if isinstance(spec, dict) and isinstance(spec.get("description"), str):
                    parts.append(spec["description"])
    return _words(" ".join(parts)[:4096])


def tools_fit(question: str, tools: Iterable[AbstractSet[str]]) -> bool:
    """Whether any tool (given by :func:`tool_words`) fits ``question`` (Rule 3)."""
    asked = {_key(w) for w in _words(question[:4096])}
    return any(asked & {_key(w) for w in words} for words in tools)


@attrs.frozen(kw_only=True)
class Turn:
    """Where the conversation stands when an answer is asked for."""

    #: The last message is a tool's result (chat ``tool``, Responses
    #: ``function_call_output``, Anthropic ``tool_result``).
    after_tool: bool = False
    #: Tool calls the assistant made since the last user message.
    calls: int = 0
    #: The text of the last user message ("" when there is none).
    question: str = ""


def conversation_turn(messages: Iterable[tuple[str, str, int]]) -> Turn:
    """The :class:`Turn` of a conversation given as ``(role, text, tool calls)`` per
    message, oldest first (role ``tool`` for a tool result)."""
    after_tool = False
    calls = 0
    question = ""
    for role, text, count in messages:
        if role == "user":
            calls, question = 0, text
        calls += count
        after_tool = role == "tool"
    return Turn(after_tool=after_tool, calls=calls, question=question)


def call_probability(turn: Turn, tools: Iterable[AbstractSet[str]], base: float) -> float:
    """The chance that an ``auto`` answer calls a tool (Rules 1-2)."""
    if turn.after_tool:
        return base * AFTER_TOOL * DECAY ** (max(1, turn.calls) - 1)
    if tools_fit(turn.question, tools):
        return base
    return base * NO_FIT
