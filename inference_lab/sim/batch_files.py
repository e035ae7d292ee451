"""Prompt token ids of OpenAI batch request bodies, for trace replay in the simulator.

Rule 1: a ``/v1/completions`` body's ``prompt`` is a string (tokenized with special
        tokens) or a list of token ids (taken as they are); a ``/v1/chat/completions``
        body's ``messages`` are rendered and tokenized as the server counts them
        (:meth:`Tokenizer.encode_chat`: the chat template, or the default rendering), with
        its ``tools``. A content given as parts keeps its text parts, joined.
Rule 2: anything else is a ValueError whose message names the body field; the trace
        reader turns it into a one-line error naming the file and line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inference_lab.api.tokenizer import ChatMessage, Tokenizer
from inference_lab.traffic.traces import Tokenize

__all__ = ["batch_tokenizer"]


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}[{i}]: must be an object")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}[{i}].text: must be a string")
                parts.append(text)
        return "".join(parts)
    raise ValueError(f"{where}: must be a string or a list of parts")


def batch_tokenizer(tokenizer: Tokenizer) -> Tokenize:
    """The trace reader's ``tokenize`` for ``openai_batch`` bodies (Rule 1)."""

    def tokenize(url: str, body: Mapping[str, Any]) -> Sequence[int]:
        if url == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return tokenizer.encode(prompt)
            if (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            ):
                return prompt
            raise ValueError("prompt: must be a string or a non-empty list of token ids")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}]: must be an object with a role")
            chat.append(
                ChatMessage(
                    m["role"],
                    _text(m.get("content"), f"messages[{i}].content"),
                    m.get("tool_calls"),
                    m.get("name"),
                    m.get("tool_call_id"),
                )
            )
        tools = body.get("tools")
        return tokenizer.encode_chat(chat, tools if isinstance(tools, list) else None)

    return tokenize
