"""The expected bytes of the test harness's streams, for its in-memory and wire tests."""

from __future__ import annotations

import json
from typing import Any

from inference_lab.api.text import VOCABULARY

__all__ = ["chat_frame", "content_frames", "head_of"]


def head_of(first_frame: bytes) -> bytes:
    """The head every frame of a stream starts with (``data: {"id":..,"model":..,``)."""
    return first_frame[: first_frame.index(b'"choices"')]


def chat_frame(head: bytes, delta: dict[str, Any], tail: bytes = b"") -> bytes:
    return (
        head
        + b'"choices":[{"index":0,"delta":'
        + json.dumps(delta, separators=(",", ":")).encode()
        + tail
        + b"}]}\n\n"
    )


def content_frames(head: bytes, count: int) -> list[bytes]:
    return [chat_frame(head, {"content": VOCABULARY[i] + " "}) for i in range(count)]
