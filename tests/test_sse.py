"""The sans-IO SSE parser: WHATWG field rules, and split-invariance (Rule 1 and 2 of sse.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.client.sse import ServerSentEvent, SSEParser


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _chat_stream(words: list[str], *, usage: bool = True) -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = _frame({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for w in words:
        out += _frame({**base, "choices": [{"index": 0, "delta": {"content": w}}]})
    out += _frame({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    if usage:
        out += _frame(
            {
                **base,
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        )
    return out + b"data: [DONE]\n\n"


def _completions_stream() -> bytes:
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    out = b""
    for w in ("the ", "of ", "and "):
        out += _frame({**base, "choices": [{"text": w, "index": 0}]})
    out += _frame({**base, "choices": [{"text": "", "index": 0, "finish_reason": "length"}]})
    return out + b"data: [DONE]\n\n"


def _error_stream() -> bytes:
    err = {
        "error": {
            "message": "The engine failed",
            "type": "server_error",
            "param": None,
            "code": "engine_failed",
        }
    }
    return _chat_stream(["the "], usage=False)[: -len(b"data: [DONE]\n\n")] + (
        _frame(err) + b"data: [DONE]\n\n"
    )


CHAT = _chat_stream(["the ", "of ", "and "])
STREAMS = {
    "chat_with_usage": CHAT,
    "completions": _completions_stream(),
    "error_then_done": _error_stream(),
    "non_ascii": _chat_stream(["héllo ", "世界 ", "🚀 ", "Ωμέγα "]),
    "crlf": CHAT.replace(b"\n", b"\r\n"),
    "cr": CHAT.replace(b"\n", b"\r"),
    "mixed_endings_comments_multiline": (
        b": keep-alive comment\r\n"
        b"event: update\rid: 7\n"
        b"data: first line\r\ndata:second line\n"
        b"data:  leading space kept\r\r"
        b"retry: 1500\n: another comment\n\n"
        b"data: [DONE]\r\n\r\n"
    ),
    "bom_and_unterminated_tail": b"\xef\xbb\xbfdata: a\n\ndata: b\n\ndata: cut off",
}


def parse_all(chunks: list[bytes]) -> list[ServerSentEvent]:
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


def test_chat_stream_events_are_the_frames_in_order() -> None:
    """The payloads of a chat stream are its JSON frames then [DONE], decoded exactly."""
    events = parse_all([CHAT])
    assert [e.data for e in events][-1] == "[DONE]"
    payloads = [json.loads(e.data) for e in events[:-1]]
    assert [p["choices"][0]["delta"].get("content") for p in payloads[1:4]] == [
        "the ",
        "of ",
        "and ",
    ]
    assert payloads[-1]["usage"]["completion_tokens"] == 3
    assert all(e.event == "message" for e in events)


def test_field_rules_follow_whatwg() -> None:
    """Multi-line data joins with \\n; one leading space is stripped; comments, retry and
    unknown fields dispatch nothing; event/id are carried; an unterminated event is dropped."""
    parser = SSEParser()
    events = parser.feed(STREAMS["mixed_endings_comments_multiline"])
    assert events == [
        ServerSentEvent("first line\nsecond line\n leading space kept", "update", "7"),
        ServerSentEvent("[DONE]", "message", "7"),
    ]
    assert parse_all([b"data\n\nfoo: bar\n\n:only a comment\n\n"]) == [ServerSentEvent("")]
    tail = SSEParser()
    assert [e.data for e in tail.feed(STREAMS["bom_and_unterminated_tail"])] == ["a", "b"]


def test_non_ascii_content_survives() -> None:
    """UTF-8 text is decoded per event, not per chunk, so every character comes through."""
    events = parse_all([STREAMS["non_ascii"][i : i + 1] for i in range(len(STREAMS["non_ascii"]))])
    contents = [json.loads(e.data)["choices"][0]["delta"].get("content") for e in events[1:5]]
    assert contents == ["héllo ", "世界 ", "🚀 ", "Ωμέγα "]
    assert all("\ufffd" not in e.data for e in events)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_every_single_split_yields_identical_events(name: str) -> None:
    """Splitting the input at any byte offset — inside \\r\\n, inside a multi-byte UTF-8
    character, inside ``data: [DONE]`` — gives exactly the events of the unsplit input."""
    data = STREAMS[name]
    whole = parse_all([data])
    assert whole, "every stream has at least one event"
    for i in range(len(data) + 1):
        assert parse_all([data[:i], data[i:]]) == whole, f"split at byte {i}"


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_byte_at_a_time_yields_identical_events(name: str) -> None:
    """The most fragmented delivery (one byte per read) changes nothing."""
    data = STREAMS[name]
    assert parse_all([data[i : i + 1] for i in range(len(data))]) == parse_all([data])


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(STREAMS)),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_random_multi_splits_yield_identical_events(name: str, cuts: list[int]) -> None:
    """Any number of cuts anywhere (including empty chunks) gives the unsplit events."""
    data = STREAMS[name]
    chunks = split_at(data, [c % (len(data) + 1) for c in cuts])
    assert parse_all(chunks) == parse_all([data])


def test_crlf_split_between_reads_is_one_line_ending() -> None:
    """A \\r at the end of one read and \\n at the start of the next end one line. Counted
    as two, the blank line between them would dispatch ``a`` and ``b`` as separate events."""
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r") == []
    assert parser.feed(b"\n\r\n") == [ServerSentEvent("a\nb")]
