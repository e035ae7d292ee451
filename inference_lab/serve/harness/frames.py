"""The SSE frames of the harness's answers, on the same head as the engine's streams.

Rule 1: a fault-injected stream's content frame ``i`` is the engine's token frame ``i``
        (``mid_*``: a reasoning or tool-call frame instead), so a client sees the same
        bytes up to the fault.
Rule 2: the fixed fault payloads (:data:`ERROR_ENVELOPE_200`, :data:`ERROR_400_IN_SSE`,
        :data:`CANCELLED_499`) are the bytes real servers send, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from inference_lab.api.encoding import DONE_FRAME, StreamEncoder
from inference_lab.api.requests import ParsedRequest
from inference_lab.api.text import WORDS
from inference_lab.core.config import FaultConfig
from inference_lab.jsonbytes import dumps

__all__ = [
    "CANCELLED_499",
    "ERROR_400_IN_SSE",
    "ERROR_ENVELOPE_200",
    "FaultFrames",
    "Frames",
]

#: ``error_envelope_200``: OpenRouter's mid-stream error envelope on a 200 stream.
ERROR_ENVELOPE_200 = (
    b'data: {"error":{"message":"Provider returned error","code":502,'
    b'"metadata":{"provider_name":"inference-lab",'
    b'"raw":"simulated upstream provider failure (fault: error_envelope_200)"}}}\n\n'
)
#: ``error_400_in_sse``: vLLM's error object inside the stream (no ``error`` wrapper).
ERROR_400_IN_SSE = (
    b'data: {"object":"error","message":"This request would exceed the model\'s maximum '
    b'context length (fault: error_400_in_sse)","type":"BadRequestError","param":null,'
    b'"code":400}\n\n'
)
#: ``cancelled_499``: the frontend-cancellation body, exactly.
CANCELLED_499 = (
    b'data: {"error":{"code":499,"message":"CancelledError: ","type":"request_cancelled"}}\n\n'
)
#: ``cut_mid_frame;utf8=true``: the torn frame's text, whose 'é' (C3 A9) the cut splits.
UTF8_CUT_WORD = "café "
#: ``mid_tool_call``: the tool call whose arguments never finish.
TOOL_CALL_ID = "call_fault_0"
TOOL_CALL_NAME = "get_current_weather"
TOOL_CALL_ARGS_OPEN = '{"location":"San Francisco, CA","notes":"'
#: The same partial payloads as raw text, for ``/v1/completions`` (no delta objects).
COMPLETION_REASONING_OPEN = "<think>"
COMPLETION_TOOL_CALL_OPEN = (
    '{"name":"get_current_weather","arguments":{"location":"San Francisco, CA","notes":"'
)


class Frames:
    """The SSE frames of one harness response, built on the same head (id, object,
    created, model) as the engine's streams."""

    def __init__(self, parsed: ParsedRequest, request_id: str, created: int) -> None:
        self.parsed = parsed
        obj = b"chat.completion.chunk" if parsed.kind == "chat" else b"text_completion"
        self.head = b'data: {"id":%s,"object":"%s","created":%d,"model":%s,' % (
            dumps(request_id),
            obj,
            created,
            dumps(parsed.model),
        )

    def chat(self, delta: Mapping[str, Any], tail: bytes = b"") -> bytes:
        """A chat chunk of choice 0 carrying ``delta`` (``tail``: more choice keys)."""
        return self.head + b'"choices":[{"index":0,"delta":' + dumps(delta) + tail + b"}]}\n\n"

    def text(self, text: str) -> bytes:
        """A completions chunk of choice 0 carrying ``text``."""
        return self.head + b'"choices":[{"text":' + dumps(text) + b',"index":0}]}\n\n'


class FaultFrames(Frames):
    """The frames of one fault-injected stream (one choice): content frame ``i`` is the
    engine's token frame ``i`` (``mid_*``: reasoning or tool-call frames instead)."""

    def __init__(
        self, fault: FaultConfig, parsed: ParsedRequest, request_id: str, created: int
    ) -> None:
        one = attrs.evolve(parsed, n=1)
        super().__init__(one, request_id, created)
        self.fault = fault
        self.request_id, self.created = request_id, created
        self.encoder = StreamEncoder(one, request_id=request_id, created=created)

    def opening(self) -> bytes:
        return self.encoder.opening()

    def content(self, start: int, stop: int) -> bytes:
        """Content frames ``start .. stop-1``, joined."""
        mode = self.fault.mode
        if mode not in ("mid_reasoning", "mid_tool_call"):
            return self.encoder.tokens(start, stop)
        return b"".join(self._partial(i) for i in range(start, stop))

    def _partial(self, i: int) -> bytes:
        word = WORDS[i % len(WORDS)]
        chat = self.parsed.kind == "chat"
        if self.fault.mode == "mid_reasoning":
            if chat:
                return self.chat({"reasoning_content": word})
            return self.text(COMPLETION_REASONING_OPEN if i == 0 else word)
        if not chat:
            return self.text(COMPLETION_TOOL_CALL_OPEN if i == 0 else word)
        if i == 0:
            call = {
                "index": 0,
                "id": TOOL_CALL_ID,
                "type": "function",
                "function": {"name": TOOL_CALL_NAME, "arguments": ""},
            }
        else:
            fragment = TOOL_CALL_ARGS_OPEN if i == 1 else word
            call = {"index": 0, "function": {"arguments": fragment}}
        return self.chat({"tool_calls": [call]})

    def torn(self, i: int) -> bytes:
        """The first part of content frame ``i``: half its bytes, or (``utf8``) a frame
        carrying :data:`UTF8_CUT_WORD` cut between the two bytes of its 'é'."""
        if not self.fault.utf8:
            frame = self.content(i, i + 1)
            return frame[: len(frame) // 2]
        if self.parsed.kind == "chat":
            frame = self.chat({"content": UTF8_CUT_WORD})
        else:
            frame = self.text(UTF8_CUT_WORD)
        return frame[: frame.rindex("é".encode()) + 1]

    def closing(self, reason: str, tokens: int, *, with_usage: bool, done: bool) -> bytes:
        """The engine's end frames for ``tokens`` tokens: the finish frame, the usage
        frame when asked for (and ``with_usage``), ``[DONE]`` when ``done``."""
        encoder = self.encoder
        if not with_usage and self.parsed.include_usage:
            parsed = attrs.evolve(self.parsed, include_usage=False)
            encoder = StreamEncoder(parsed, request_id=self.request_id, created=self.created)
        frames = encoder.closing(reason, tokens)
        return frames if done else frames.removesuffix(DONE_FRAME)
