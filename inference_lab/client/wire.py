"""The OpenAI wire format as the load generator needs it: prompts, request bodies, stream
frames, error bodies. Pure functions and one small accumulator; no I/O.

Rule 1: prompts are sized with the server's own counting rule (``inference_lab.api.requests``):
  ``ceil(utf8_bytes / 4)`` tokens, and for chat the text ``"user: <content>"`` plus 5 %
  template overhead (``raw * 105 // 100``). The server's count is reported back in the
  usage frame, so a mismatch is visible in every record.
Rule 2: per-token work is a few substring tests on the frame text. A frame is JSON-decoded
  only when it may carry something other than one token's text — a usage object, an
  error, a finish reason, a role — or is not in the compact form the fast path recognises.
  The fast path only takes compact JSON (no ``": ``) and is exact there: a quote inside a
  string value is always escaped, so generated text can never forge or hide a marker such
  as ``"usage":{``; text that merely resembles one only costs a decode.
"""

from __future__ import annotations

import email.utils
import json
import math
from typing import Any, Literal

__all__ = [
    "Endpoint",
    "StreamAccumulator",
    "build_prompt",
    "chat_prompt_tokens",
    "completion_prompt_tokens",
    "encode_request",
    "endpoint_path",
    "models_path",
    "parse_completion_body",
    "parse_error_body",
    "parse_model_ids",
    "PACING_LAG_HEADER",
    "parse_pacing_lag",
    "parse_retry_after",
]

Endpoint = Literal["chat", "completions"]

_FILLER = (
    b"lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    b"incididunt ut labore et dolore magna aliqua ut enim ad minim veniam quis nostrud "
)
_CHAT_PREFIX_BYTES = len(b"user: ")


def completion_prompt_tokens(text_bytes: int) -> int:
    """The server's token count for a completions prompt of ``text_bytes`` UTF-8 bytes."""
    return math.ceil(text_bytes / 4)


def chat_prompt_tokens(content_bytes: int) -> int:
    """The server's token count for one user message of ``content_bytes`` UTF-8 bytes."""
    raw = math.ceil((_CHAT_PREFIX_BYTES + content_bytes) / 4)
    return raw * 105 // 100


def build_prompt(tokens: int, endpoint: Endpoint) -> str:
    """ASCII text the server counts as ``tokens`` prompt tokens, or as close as it allows.

    Completions hit every count exactly (4 bytes per token). Chat cannot: the 5 % overhead
    skips some counts (raw 20 → 21) and the ``"user: "`` prefix alone is 2 tokens; then the
    nearest reachable count is used (the lower one on a tie).
    """
    if tokens < 1:
        raise ValueError(f"prompt tokens must be >= 1, got {tokens}")
    if endpoint == "completions":
        size = 4 * tokens
    else:
        # Smallest size reaching the target; count grows by at most 2 per 4 bytes.
        size = max(0, 4 * (tokens * 100 // 105) - _CHAT_PREFIX_BYTES - 8)
        while chat_prompt_tokens(size) < tokens:
            size += 1
        if size > 0 and chat_prompt_tokens(size) > tokens:
            below = size - 1
            if tokens - chat_prompt_tokens(below) <= chat_prompt_tokens(size) - tokens:
                size = below
    return _filler(size)


def _filler(size: int) -> str:
    reps = size // len(_FILLER) + 1
    return (_FILLER * reps)[:size].decode("ascii")


def endpoint_path(base_path: str, endpoint: Endpoint) -> str:
    """Request target for ``endpoint`` under the URL's path prefix. A prefix that already
    ends in ``/v1`` (the OpenAI SDK's base URL convention) is not doubled."""
    tail = "/chat/completions" if endpoint == "chat" else "/completions"
    if base_path.endswith("/v1"):
        return base_path + tail
    return base_path + "/v1" + tail


def models_path(base_path: str) -> str:
    """``GET`` target of the model list under the URL's path prefix (``/v1`` not doubled,
    as in :func:`endpoint_path`)."""
    if base_path.endswith("/v1"):
        return base_path + "/models"
    return base_path + "/v1/models"


def parse_model_ids(body: bytes) -> list[str] | None:
    """The ids of an OpenAI model list (``{"object": "list", "data": [{"id": …}, …]}``), in
    the server's order; None when the body is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def parse_retry_after(value: bytes, now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: delta-seconds (``2``; a decimal is
    accepted) or an HTTP date, counted from the Unix time ``now``; never negative. None
    for a value that is neither (RFC 9110, section 10.2.3)."""
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is read as such
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


#: The header an inference-lab server puts on every generation answer: how late its
#: model's engine was when the request reached admission, in milliseconds.
PACING_LAG_HEADER = b"inference-lab-pacing-lag-ms"


def parse_pacing_lag(value: bytes) -> float | None:
    """Seconds of an ``inference-lab-pacing-lag-ms`` value (``1.25`` is 1.25 ms); None
    for one that is not a finite number >= 0."""
    try:
        ms = float(value.decode("latin-1"))
    except ValueError:
        return None
    return ms / 1e3 if math.isfinite(ms) and ms >= 0.0 else None


def encode_request(
    *, model: str, endpoint: Endpoint, prompt: str, max_tokens: int, stream: bool
) -> bytes:
    """The JSON body (compact, UTF-8). Streams ask for the usage frame; every request asks
    for ``ignore_eos`` (vLLM's), so each answer runs to its ``max_tokens`` and the load's
    output lengths are the ones the server generates."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens
    body["ignore_eos"] = True
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def parse_error_body(body: bytes) -> tuple[str | None, str | None, str | None]:
    """``(type, code, message)`` from an OpenAI error envelope; ``None`` where absent or the
    body is not one (the status code alone still classifies the response)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None, _first_line(body.decode("utf-8", "replace")) or None
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return None, None, None
    return _opt_str(err.get("type")), _opt_str(err.get("code")), _opt_str(err.get("message"))


def parse_completion_body(body: bytes) -> tuple[int | None, int | None, str | None, bool]:
    """For a non-streamed 200: ``(prompt_tokens, completion_tokens, finish_reason, ok)``;
    ``ok`` is False when the body is not a completion object."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None, None, False
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return None, None, None, False
    prompt, completion = _usage(obj.get("usage"))
    finish = None
    for choice in obj["choices"]:
        if isinstance(choice, dict) and choice.get("finish_reason"):
            finish = _opt_str(choice["finish_reason"])
    return prompt, completion, finish, True


class StreamAccumulator:
    """What one streamed response said, fed one SSE data payload at a time.

    ``feed`` returns how many tokens the payload carried (0 or 1 for this server, which
    sends one frame per token) so the caller can timestamp them.
    """

    __slots__ = (
        "completion_tokens",
        "done",
        "error_code",
        "error_message",
        "error_type",
        "finish_reason",
        "frames",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        self.frames = 0
        self.done = False
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error_type: str | None = None
        self.error_code: str | None = None
        self.error_message: str | None = None

    def feed(self, data: str) -> int:
        """Consume one event's data; return the number of tokens it carried."""
        self.frames += 1
        if (
            '"usage":{' not in data
            and '"error"' not in data
            and '"finish_reason":"' not in data
            and '": ' not in data
        ):
            # Fast path (Rule 2): a compact content frame; only emptiness needs checking.
            i = data.find('"content":"')
            if i >= 0:
                return 0 if data.startswith('"', i + 11) else 1
            i = data.find('"text":"')
            if i >= 0:
                return 0 if data.startswith('"', i + 8) else 1
            if data == "[DONE]":
                self.done = True
                return 0
        return self._slow(data)

    def _slow(self, data: str) -> int:
        try:
            obj = json.loads(data)
        except ValueError:
            if data.strip() == "[DONE]":
                self.done = True
            return 0
        if not isinstance(obj, dict):
            return 0
        err = obj.get("error")
        if err is not None:
            self._error(err)
        if isinstance(obj.get("usage"), dict):
            self.prompt_tokens, self.completion_tokens = _usage(obj["usage"])
        choices = obj.get("choices")
        return self._choices(choices) if isinstance(choices, list) else 0

    def _error(self, err: object) -> None:
        """An error frame: its type, code and message (a bare value is the message)."""
        if isinstance(err, dict):
            self.error_type = _opt_str(err.get("type")) or "stream_error"
            self.error_code = _opt_str(err.get("code"))
            self.error_message = _opt_str(err.get("message"))
        else:
            self.error_type = "stream_error"
            self.error_message = str(err)

    def _choices(self, choices: list[object]) -> int:
        """The tokens a frame's choices carry (one per choice with content, reasoning or
        text), noting a finish reason."""
        tokens = 0
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("content") or delta.get("reasoning_content"):
                    tokens += 1
            elif choice.get("text"):
                tokens += 1
            if choice.get("finish_reason"):
                self.finish_reason = _opt_str(choice["finish_reason"])
        return tokens


def _usage(usage: object) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    return _opt_int(usage.get("prompt_tokens")), _opt_int(usage.get("completion_tokens"))


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0][:200] if text else ""
