"""The harness's directives: the fault header and the scripted-answer marker.

Rule 1: a malformed fault header is a 400 ``invalid_fault_directive`` naming the problem,
        raised before any response starts.
Rule 2: a malformed scripted marker is ignored (it is ordinary prompt text); the last
        well-formed marker across a chat's messages wins.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from inference_lab.core.config import FAULT_MODES, FaultConfig
from inference_lab.errors import ApiError
from inference_lab.jsonbytes import dumps
from inference_lab.validation import FieldError

__all__ = [
    "FAULT_HEADER",
    "MARKER",
    "Script",
    "ScriptedCall",
    "find_script",
    "invalid_directive",
    "parse_fault_header",
]

#: The request header carrying a fault directive.
FAULT_HEADER = b"x-inference-lab-fault"
#: What starts a scripted answer in a chat message; one JSON object follows it.
MARKER = "<<respond:"

_FINISH_REASONS = ("stop", "length", "tool_calls")
_DECODER = json.JSONDecoder()
_SCRIPT_KEYS = frozenset({"text", "tool_calls", "finish_reason"})
_CALL_KEYS = frozenset({"name", "arguments", "id"})


def invalid_directive(message: str, param: str | None = None) -> ApiError:
    """The 400 ``invalid_fault_directive`` saying ``message``."""
    return ApiError(400, "invalid_fault_directive", f"invalid fault directive: {message}", param)


def _flag(key: str, value: str) -> bool:
    if value in ("true", "false"):
        return value == "true"
    raise invalid_directive(f"{key} must be true or false, got {value!r}")


def _count(key: str, value: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 9:
        raise invalid_directive(f"{key} must be an integer >= 0, got {value!r}")
    return int(value)


def parse_fault_header(value: bytes) -> FaultConfig:
    """The directive of an ``x-inference-lab-fault`` header,
    ``<mode>[;after_chunks=N][;delay_ms=N][;utf8=true|false][;paced=true|false]``.
    Raises :class:`ApiError` 400 ``invalid_fault_directive`` naming the problem."""
    text = value.decode("latin-1").strip()
    mode, *params = (part.strip() for part in text.split(";"))
    if not mode:
        raise invalid_directive(
            "empty; expected <mode>[;after_chunks=N][;delay_ms=N][;utf8=..][;paced=..]"
        )
    if mode not in FAULT_MODES:
        raise invalid_directive(f"unknown mode {mode!r}; expected one of {', '.join(FAULT_MODES)}")
    fields: dict[str, Any] = {}
    for part in params:
        if not part:
            continue
        key, sep, raw = (p.strip() for p in part.partition("="))
        if not sep:
            raise invalid_directive(f"expected key=value, got {part!r}")
        if key in fields:
            raise invalid_directive(f"{key} is given twice")
        if key in ("after_chunks", "delay_ms"):
            fields[key] = _count(key, raw)
        elif key in ("utf8", "paced"):
            fields[key] = _flag(key, raw)
        else:
            raise invalid_directive(
                f"unknown parameter {key!r}; expected after_chunks, delay_ms, utf8, paced"
            )
    try:
        return FaultConfig(mode=mode, **fields)
    except FieldError as exc:
        raise invalid_directive(f"{exc.field} {exc}") from None
    except ValueError as exc:  # a range validator's Invalid names its field
        raise invalid_directive(f"{getattr(exc, 'field', None) or 'value'} {exc}") from None


@attrs.frozen(kw_only=True)
class ScriptedCall:
    """One tool call of a scripted answer; ``arguments`` is already the wire string."""

    name: str
    arguments: str
    id: str | None = None


@attrs.frozen(kw_only=True)
class Script:
    """A scripted answer (``<<respond:{...}``): what the server answers, exactly."""

    text: str | None = None
    tool_calls: tuple[ScriptedCall, ...] = ()
    finish_reason: str | None = None

    @property
    def reason(self) -> str:
        """The finish reason sent: the script's if it is ``stop``, ``length`` or
        ``tool_calls``; else ``tool_calls`` when there are calls, else ``stop``."""
        if self.finish_reason in _FINISH_REASONS:
            return self.finish_reason
        return "tool_calls" if self.tool_calls else "stop"


def _script_of(value: Any) -> Script | None:
    """The :class:`Script` a marker's JSON value describes, or None when it is malformed
    (not an object, an unknown key, a value of the wrong type)."""
    if type(value) is not dict or not value.keys() <= _SCRIPT_KEYS:
        return None
    text = value.get("text")
    reason = value.get("finish_reason")
    calls = value.get("tool_calls", [])
    if (text is not None and type(text) is not str) or (
        reason is not None and type(reason) is not str
    ):
        return None
    if type(calls) is not list:
        return None
    parsed: list[ScriptedCall] = []
    for call in calls:
        if type(call) is not dict or not call.keys() <= _CALL_KEYS:
            return None
        name, call_id = call.get("name"), call.get("id")
        if type(name) is not str or not name or (call_id is not None and type(call_id) is not str):
            return None
        arguments = call.get("arguments", {})
        # A string is sent as given (a client may script broken JSON on purpose).
        wire = arguments if type(arguments) is str else dumps(arguments).decode()
        parsed.append(ScriptedCall(name=name, arguments=wire, id=call_id))
    return Script(text=text, tool_calls=tuple(parsed), finish_reason=reason)


def _message_text(content: Any) -> str:
    if type(content) is str:
        return content
    if type(content) is list:
        return "".join(
            part["text"] for part in content if type(part) is dict and type(part.get("text")) is str
        )
    return ""


def find_script(raw: Mapping[str, Any]) -> Script | None:
    """The scripted answer of a chat body: the last well-formed ``<<respond:{json}``
    marker across its messages (whitespace may precede the object); malformed markers
    are ignored. None when there is none."""
    found: Script | None = None
    messages = raw.get("messages")
    if type(messages) is not list:
        return None
    for message in messages:
        text = _message_text(message.get("content")) if type(message) is dict else ""
        at = text.find(MARKER)
        while at >= 0:
            start = at + len(MARKER)
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                value, _ = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                value = None
            script = _script_of(value)
            if script is not None:
                found = script
            at = text.find(MARKER, start)
    return found
