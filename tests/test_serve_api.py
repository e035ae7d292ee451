"""The pure OpenAI layer: validation, token counting, wire bytes (``docs/serve.md``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inference_lab.api.encoding import StreamEncoder, completion_body
from inference_lab.api.requests import (
    ParsedRequest,
    count_chat_tokens,
    count_text_tokens,
    parse_capacity_request,
    parse_chat_request,
    parse_completion_request,
)
from inference_lab.api.schema import parse_json_object
from inference_lab.api.text import VOCABULARY, placeholder_text
from inference_lab.errors import ApiError

MSG = [{"role": "user", "content": "hello world"}]


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": MSG}
    body.update(fields)
    return body


def refusal(raw: Any, parse: Any = parse_chat_request) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(raw, 256)
    return info.value


# -- token counting: the worked examples of docs/serve.md ----------------------------------


def test_chat_hello_world_counts_five_tokens() -> None:
    """`user: hello world` is 17 bytes -> ceil(17/4) = 5 -> 5 * 105 // 100 = 5."""
    assert parse_chat_request(chat(), 256).prompt_tokens == 5


def test_chat_with_tools_counts_twenty_one_tokens() -> None:
    """tools JSON (sorted keys, compact) + `user: hi` is 77 bytes -> 20 -> 21."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = chat(messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert parse_chat_request(body, 256).prompt_tokens == 21


def test_completions_hello_world_counts_three_tokens() -> None:
    """A completions text prompt has no template overhead: ceil(11 / 4) = 3."""
    parsed = parse_completion_request({"model": "m", "prompt": "hello world"}, 256)
    assert parsed.prompt_tokens == 3


def test_token_id_prompts_count_exactly() -> None:
    assert parse_completion_request({"model": "m", "prompt": [5, 6, 7]}, 256).prompt_tokens == 3
    assert parse_completion_request({"model": "m", "prompt": [[1, 2]]}, 256).prompt_tokens == 2


def test_text_tokens_count_utf8_bytes() -> None:
    """Four bytes per token, rounded up, on UTF-8 bytes (é is two bytes)."""
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("éé") == 1


def test_chat_content_parts_and_tool_calls_are_counted() -> None:
    """Parts' text fields are concatenated; assistant tool_calls follow as sorted compact
    JSON after a newline when the content is not empty, directly when it is."""
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    calls_json = json.dumps(calls, separators=(",", ":"), sort_keys=True)
    with_text = [("assistant", "ok", calls)]
    without_text = [("assistant", "", calls)]
    expected_with = count_text_tokens(f"assistant: ok\n{calls_json}") * 105 // 100
    expected_without = count_text_tokens(f"assistant: {calls_json}") * 105 // 100
    assert count_chat_tokens(with_text, None) == expected_with
    assert count_chat_tokens(without_text, None) == expected_without
    parts = [
        {"type": "text", "text": "hello"},
        {"type": "image_url"},
        {"type": "text", "text": " world"},
    ]
    body = chat(messages=[{"role": "user", "content": parts}])
    assert parse_chat_request(body, 256).prompt_tokens == 5


def test_null_content_counts_as_empty() -> None:
    body = chat(messages=[{"role": "assistant", "content": None}, {"role": "user"}])
    # "assistant: \nuser: " is 18 bytes -> 5 -> 5
    assert parse_chat_request(body, 256).prompt_tokens == 5


# -- max_tokens and friends ---------------------------------------------------------------


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat_request(chat(max_tokens=5, max_completion_tokens=7), 256).max_tokens == 7
    assert parse_chat_request(chat(max_tokens=5), 256).max_tokens == 5
    assert parse_chat_request(chat(max_tokens=5, max_completion_tokens=None), 256).max_tokens == 5


def test_default_max_tokens_applies_when_none_sent() -> None:
    assert parse_chat_request(chat(), 99).max_tokens == 99
    assert parse_completion_request({"model": "m", "prompt": "x"}, 42).max_tokens == 42


def test_unknown_fields_are_ignored() -> None:
    body = chat(temperature=0.2, top_p=1, seed=3, user="u", logprobs=None, frequency_penalty=0)
    assert parse_chat_request(body, 256).model == "m"


def test_include_usage_only_counts_for_streams() -> None:
    options = {"include_usage": True}
    assert parse_chat_request(chat(stream=True, stream_options=options), 256).include_usage
    assert not parse_chat_request(chat(stream=False, stream_options=options), 256).include_usage


def test_priority_is_passed_through() -> None:
    assert parse_chat_request(chat(priority=-3), 256).priority == -3
    assert parse_completion_request({"model": "m", "prompt": "x", "priority": 4}, 1).priority == 4


def test_echo_text_is_the_prompt() -> None:
    parsed = parse_completion_request({"model": "m", "prompt": "hi there", "echo": True}, 1)
    assert parsed.echo_text == "hi there"
    assert parse_completion_request({"model": "m", "prompt": "hi"}, 1).echo_text == ""


# -- validation errors: status, code, param, message ---------------------------------------

INVALID_CHAT = [
    (
        chat(max_tokens=10.5),
        "max_tokens",
        "max_tokens must be an integer in 1..2147483647, got 10.5",
    ),
    (
        chat(max_tokens=True),
        "max_tokens",
        "max_tokens must be an integer in 1..2147483647, got true",
    ),
    (chat(max_tokens=0), "max_tokens", "max_tokens must be an integer in 1..2147483647, got 0"),
    (chat(max_tokens="7"), "max_tokens", 'max_tokens must be an integer in 1..2147483647, got "7"'),
    (
        chat(max_completion_tokens=-1),
        "max_completion_tokens",
        "max_completion_tokens must be an integer in 1..2147483647, got -1",
    ),
    (chat(stream="false"), "stream", 'stream must be a boolean, got "false"'),
    (chat(stream=1), "stream", "stream must be a boolean, got 1"),
    (
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        'stream_options.include_usage must be a boolean, got "yes"',
    ),
    (chat(stream_options=[1]), "stream_options", "stream_options must be an object, got [1]"),
    ({"messages": MSG}, "model", "model is required"),
    (chat(model=7), "model", "model must be a string, got 7"),
    ({"model": "m"}, "messages", "messages is required"),
    (chat(messages=[]), "messages", "messages must be a non-empty array of messages, got []"),
    (chat(messages="hi"), "messages", 'messages must be a non-empty array of messages, got "hi"'),
    (chat(messages=["hi"]), "messages[0]", 'messages[0] must be an object, got "hi"'),
    (chat(messages=[{"content": "x"}]), "messages[0].role", "messages[0].role is required"),
    (
        chat(messages=[{"role": "user", "content": 5}]),
        "messages[0].content",
        "messages[0].content must be a string, an array of content parts, or null, got 5",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"text": 5}]}]),
        "messages[0].content[0].text",
        "messages[0].content[0].text must be a string, got 5",
    ),
    (chat(tools={"a": 1}), "tools", 'tools must be an array, got {"a": 1}'),
    (chat(priority=1.5), "priority", "priority must be an integer, got 1.5"),
    (chat(n="2"), "n", 'n must be an integer, got "2"'),
]


@pytest.mark.parametrize(("body", "param", "message"), INVALID_CHAT)
def test_invalid_chat_fields_are_400_invalid_value_naming_the_field(
    body: dict[str, Any], param: str, message: str
) -> None:
    error = refusal(body)
    assert (error.status, error.code, error.type) == (400, "invalid_value", "invalid_request_error")
    assert error.param == param
    assert error.message == message


@pytest.mark.parametrize(("prompt", "count"), [(["a", "b"], 2), ([[1], [2], [3]], 3)])
def test_one_prompt_parses_exactly_one_prompt(prompt: Any, count: int) -> None:
    """``parse_completion_request`` is the single-prompt parse (a batch is
    ``parse_completion_requests``); an empty list is never a prompt."""
    error = refusal({"model": "m", "prompt": prompt}, parse_completion_request)
    assert (error.status, error.code, error.param) == (400, "invalid_prompt", "prompt")
    assert error.message == f"expected exactly 1 prompt, got {count}"
    error = refusal({"model": "m", "prompt": []}, parse_completion_request)
    assert (error.status, error.code, error.message) == (
        400,
        "invalid_prompt",
        "prompt must hold at least one prompt",
    )


@pytest.mark.parametrize("prompt", [5, None, [1, "a"], [True], [[1, "x"]], {"a": 1}, [-1]])
def test_malformed_completions_prompt_is_invalid_value(prompt: Any) -> None:
    error = refusal({"model": "m", "prompt": prompt}, parse_completion_request)
    assert (error.status, error.code, error.param) == (400, "invalid_value", "prompt")


def test_completions_field_types_are_strict() -> None:
    error = refusal({"model": "m", "prompt": "x", "echo": "true"}, parse_completion_request)
    assert (error.param, error.message) == ("echo", 'echo must be a boolean, got "true"')
    error = refusal({"model": "m", "prompt": "x", "max_tokens": 2.0}, parse_completion_request)
    assert error.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "Request body must be a JSON object: Expecting value: line 1 column 1"),
        (b"{bad", "Request body must be a JSON object: Expecting property name"),
        (b"[1]", "Request body must be a JSON object, got an array"),
        (b'"x"', "Request body must be a JSON object, got a string"),
        (b"\xff", "Request body must be a JSON object"),
    ],
)
def test_bodies_that_are_not_json_objects_are_invalid_json(body: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_object(body)
    error = info.value
    assert (error.status, error.code, error.param) == (400, "invalid_json", None)
    assert error.message.startswith(fragment)


def test_error_envelope_is_compact_with_spec_key_order() -> None:
    body = ApiError(400, "invalid_value", "x must be y", "x").body()
    expected = b'{"error":{"message":"x must be y","type":"invalid_request_error","param":"x","code":"invalid_value"}}'
    assert body == expected


# -- capacity bodies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_seqs": 2.0}, "max_num_seqs"),
        ({"max_num_seqs": "4"}, "max_num_seqs"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"max_waiting": False}, "max_waiting"),
        ({"model": 3}, "model"),
        ({"max_num_seq": 4}, "max_num_seq"),
    ],
)
def test_capacity_body_validation_names_the_field(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_capacity_request(raw)
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", param)


def test_capacity_body_all_optional() -> None:
    change = parse_capacity_request({})
    assert (change.model, change.max_num_seqs, change.max_waiting) == (None, None, None)
    change = parse_capacity_request({"model": "m", "max_num_seqs": 1, "max_waiting": 0})
    assert (change.model, change.max_num_seqs, change.max_waiting) == ("m", 1, 0)


# -- response bytes ---------------------------------------------------------------------------


def test_placeholder_text_cycles_the_fifty_words_from_the_first() -> None:
    assert len(VOCABULARY) == 50 and VOCABULARY[0] == "the" and VOCABULARY[-1] == "would"
    assert placeholder_text(3) == "the of and "
    text = placeholder_text(52)
    assert text.split() == [*VOCABULARY, "the", "of"]
    assert placeholder_text(2, start=49) == "would the "
    assert placeholder_text(0) == ""


def _parsed(kind: Any = "chat", **fields: Any) -> ParsedRequest:
    base: dict[str, Any] = {
        "kind": kind,
        "model": "m",
        "prompt_tokens": 5,
        "max_tokens": 3,
        "stream": True,
        "include_usage": False,
        "priority": 0,
    }
    base.update(fields)
    return ParsedRequest(**base)


def test_chat_stream_frames_are_exact() -> None:
    enc = StreamEncoder(_parsed(include_usage=True), request_id="chatcmpl-1", created=7)
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
    assert (
        enc.opening()
        == (f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant"}}}}]}}\n\n').encode()
    )
    assert (
        enc.tokens(0, 2)
        == (
            f'data: {head}"choices":[{{"index":0,"delta":{{"content":"the "}}}}]}}\n\n'
            f'data: {head}"choices":[{{"index":0,"delta":{{"content":"of "}}}}]}}\n\n'
        ).encode()
    )
    assert (
        enc.closing("length", 2)
        == (
            f'data: {head}"choices":[{{"index":0,"delta":{{}},"finish_reason":"length"}}]}}\n\n'
            f'data: {head}"choices":[],"usage":{{"prompt_tokens":5,"completion_tokens":2,'
            '"total_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
            "data: [DONE]\n\n"
        ).encode()
    )


def test_completions_stream_frames_are_exact() -> None:
    enc = StreamEncoder(_parsed("completions"), request_id="cmpl-1", created=7)
    head = '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m",'
    assert enc.opening() == b""
    assert (
        enc.tokens(50, 51) == f'data: {head}"choices":[{{"text":"the ","index":0}}]}}\n\n'.encode()
    )
    # a finished stream's last token is the text's last word: no trailing space
    assert enc.tokens(50, 51, final=True) == (
        f'data: {head}"choices":[{{"text":"the","index":0}}]}}\n\n'.encode()
    )
    assert (
        enc.closing("stop", 1)
        == (
            f'data: {head}"choices":[{{"text":"","index":0,"finish_reason":"stop"}}]}}\n\n'
            "data: [DONE]\n\n"
        ).encode()
    )


def test_failure_frames_carry_engine_failed_then_done() -> None:
    frames = StreamEncoder.failure("boom")
    assert frames == (
        b'data: {"error":{"message":"boom","type":"server_error","param":null,'
        b'"code":"engine_failed"}}\n\ndata: [DONE]\n\n'
    )


def test_non_streaming_bodies_strip_the_trailing_space() -> None:
    body = json.loads(
        completion_body(
            _parsed(stream=False),
            request_id="chatcmpl-1",
            created=7,
            completion_tokens=3,
            finish_reason="length",
        )
    )
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "the of and"},
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    echo = _parsed("completions", stream=False, echo_text="hi ")
    body = json.loads(
        completion_body(
            echo, request_id="cmpl-1", created=7, completion_tokens=2, finish_reason="stop"
        )
    )
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"text": "hi the of", "index": 0, "finish_reason": "stop"}]
