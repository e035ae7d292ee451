"""The pure OpenAI layer beyond the basics: tokenizer counts, stop, n, logprobs, and
hostile input (nesting, surrogates, huge values)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from inference_lab.api.encoding import StreamEncoder, completion_body, new_request_id, random_hex
from inference_lab.api.requests import (
    MAX_CAPACITY,
    ParsedRequest,
    parse_capacity_request,
    parse_chat_request,
    parse_completion_request,
)
from inference_lab.api.schema import parse_json_object
from inference_lab.api.text import VOCABULARY, placeholder_text, stop_point
from inference_lab.api.tokenizer import Tokenizer, load_tokenizer
from inference_lab.errors import ApiError, error_body, truncate_echo
from inference_lab.jsonbytes import dumps
from tests.tokenizer_util import TEMPLATE, train_bpe, write_template

MSG = [{"role": "user", "content": "hello world"}]


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": MSG}
    body.update(fields)
    return body


def completion(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "prompt": "hello world"}
    body.update(fields)
    return body


def refusal(raw: Any, parse: Any = parse_chat_request, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(raw, 256, **kw)
    return info.value


def body_of(parsed: ParsedRequest, tokens: int, reason: str = "length") -> dict[str, Any]:
    raw = completion_body(
        parsed, request_id="id-1", created=7, completion_tokens=tokens, finish_reason=reason
    )
    result: dict[str, Any] = json.loads(raw)
    return result


def frames(data: bytes) -> list[Any]:
    """The JSON payloads of an SSE byte string (``[DONE]`` as the string)."""
    out: list[Any] = []
    for event in data.split(b"\n\n"):
        if not event:
            continue
        assert event.startswith(b"data: ")
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def stream_of(parsed: ParsedRequest, tokens: int, reason: str = "length") -> list[Any]:
    """Every frame of a stream of ``tokens`` tokens per choice, delivered in two runs."""
    enc = StreamEncoder(parsed, request_id="id-1", created=7)
    half = tokens // 2
    data = enc.opening() + enc.tokens(0, half) + enc.tokens(half, tokens)
    return frames(data + enc.closing(reason, tokens))


def streamed_text(payloads: list[Any], index: int = 0) -> str:
    text = ""
    for p in payloads:
        if p == "[DONE]" or not p["choices"]:
            continue
        for choice in p["choices"]:
            if choice["index"] != index:
                continue
            if "delta" in choice:
                text += choice["delta"].get("content", "")
            else:
                text += choice["text"]
    return text


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(train_bpe(tmp_path_factory.mktemp("bpe"), bos=True))


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("templated")
    path = train_bpe(directory, bos=True)
    write_template(directory, TEMPLATE)
    return load_tokenizer(path)


# -- prompt tokens with a tokenizer ---------------------------------------------------------


def test_completions_prompt_tokens_are_the_tokenizers_exact_count(bpe: Tokenizer) -> None:
    """With a tokenizer the completions prompt counts exactly (with the BOS vLLM adds),
    not by the byte rule."""
    prompt = "the quick brown fox jumps over the lazy dog " * 10
    parsed = parse_completion_request(completion(prompt=prompt), 256, tokenizer=bpe)
    assert parsed.prompt_tokens == len(bpe.encode(prompt)) == bpe.count(prompt)
    assert (
        parsed.prompt_tokens
        != parse_completion_request(completion(prompt=prompt), 256).prompt_tokens
    )


def test_chat_prompt_tokens_count_the_rendered_messages(
    bpe: Tokenizer, templated: Tokenizer
) -> None:
    """Chat counts the default rendering exactly (no 5 % overhead) or, with a chat
    template, the template's rendering."""
    body = chat(messages=[{"role": "user", "content": "hello world"}])
    assert parse_chat_request(body, 256, tokenizer=bpe).prompt_tokens == bpe.count(
        "user: hello world"
    )
    rendered = "<s><|user|>hello world\n<|assistant|>"
    expected = len(templated.encode(rendered, add_special_tokens=False))
    assert parse_chat_request(body, 256, tokenizer=templated).prompt_tokens == expected


def test_chat_template_refusal_is_a_400_naming_messages(templated: Tokenizer) -> None:
    error = refusal(chat(messages=[{"role": "bad", "content": "x"}]), tokenizer=templated)
    assert (error.status, error.code, error.param) == (400, "invalid_value", "messages")
    assert "roles must be user or assistant" in error.message


def test_token_id_prompts_count_exactly_and_echo_their_text(bpe: Tokenizer) -> None:
    """Token ids count as sent; with a tokenizer echo is their decoded text, and an id
    outside the vocabulary is a 400 naming prompt."""
    ids = bpe.encode("hello world", add_special_tokens=False)
    parsed = parse_completion_request(completion(prompt=ids, echo=True), 256, tokenizer=bpe)
    assert (parsed.prompt_tokens, parsed.echo_text) == (len(ids), "hello world")
    error = refusal(completion(prompt=[bpe.vocab_size]), parse_completion_request, tokenizer=bpe)
    assert (error.status, error.param) == (400, "prompt")
    # without a tokenizer ids have no text: they echo as placeholder words
    parsed = parse_completion_request(completion(prompt=[0, 51], echo=True), 256)
    assert parsed.echo_text == "the of "


# -- stop -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "tokens", "text"),
    [
        ("and", 3, "the of "),  # completes in token 3, cut before it
        (["of and"], 3, "the "),  # spans tokens 2..3
        ("he", 1, "t"),  # inside token 1
        (" ", 1, "the"),
        (["would", "and"], 3, "the of "),  # the earliest to complete wins
        (["to", "and to"], 4, "the of "),  # both complete in token 4: the earlier start
        (["h", "t"], 1, ""),
        ("the of", 2, ""),
    ],
)
def test_stop_cuts_the_text_and_counts_tokens_as_vllm(stop: Any, tokens: int, text: str) -> None:
    """The output stops before the first stop string; the token in which it completes is
    generated and counted; finish_reason is stop; chat and completions alike."""
    for parse, raw in ((parse_chat_request, chat), (parse_completion_request, completion)):
        parsed = parse(raw(stop=stop, max_tokens=100), 256)
        assert (parsed.stop_after, parsed.output_cap) == (tokens, tokens)
        assert parsed.output_text(tokens) == text
        body = body_of(parsed, tokens, "stop")
        choice = body["choices"][0]
        assert choice.get("text", choice.get("message", {}).get("content")) == text
        assert choice["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == tokens


def test_stop_beyond_max_tokens_does_not_stop() -> None:
    """A stop string that would complete after max_tokens changes nothing."""
    parsed = parse_chat_request(chat(stop="and", max_tokens=2), 256)
    assert (parsed.stop_after, parsed.output_cap) == (None, 2)
    assert body_of(parsed, 2)["choices"][0]["message"]["content"] == "the of"
    far = parse_chat_request(chat(stop="would", max_tokens=1000), 256)
    assert far.stop_after == VOCABULARY.index("would") + 1
    assert parse_chat_request(chat(stop="zebra"), 256).stop_after is None


def test_stop_completing_in_the_last_allowed_token_reports_stop() -> None:
    """When the stop string completes in token max_tokens the engine says length; the
    answer says stop, as vLLM does."""
    parsed = parse_chat_request(chat(stop="and", max_tokens=3), 256)
    assert parsed.stop_after == 3
    body = body_of(parsed, 3, "length")
    assert body["choices"][0]["finish_reason"] == "stop"
    closing = frames(StreamEncoder(parsed, request_id="i", created=1).closing("length", 3))
    assert closing[0]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "stop",
    [5, ["a", 5], ["a", "b", "c", "d", "e"], "", ["x", ""], {"a": 1}, [["a"]], True],
)
def test_invalid_stop_is_400_naming_stop(stop: Any) -> None:
    for parse, raw in ((parse_chat_request, chat), (parse_completion_request, completion)):
        error = refusal(raw(stop=stop), parse)
        assert (error.status, error.code, error.param) == (400, "invalid_value", "stop")
        assert "at most 4 non-empty strings" in error.message


def test_null_or_empty_stop_means_none() -> None:
    assert parse_chat_request(chat(stop=None), 256).stop_after is None
    assert parse_chat_request(chat(stop=[]), 256).stop_after is None


WORD_TEXT = placeholder_text(120)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0, len(WORD_TEXT) - 1), st.integers(1, 12)).map(
                lambda t: WORD_TEXT[t[0] : t[0] + t[1]]
            ),
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=6),
        ).filter(bool),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 80),
    st.sampled_from(["chat", "completions"]),
    st.integers(1, 3),
    st.sampled_from([None, 0, 2]),
)
def test_streamed_text_always_concatenates_to_the_answer(
    stops: list[str], max_tokens: int, kind: str, n: int, logprobs: int | None
) -> None:
    """For any stop strings, n and logprobs: each choice's stream sends one frame per
    token; with a stop cut its texts concatenate exactly to the non-streaming text, and
    no returned text contains a stop string."""
    if kind == "chat":
        raw = chat(stop=stops, max_tokens=max_tokens, n=n, stream=True)
        if logprobs is not None:
            raw.update(logprobs=True, top_logprobs=logprobs)
        parsed = parse_chat_request(raw, 256)
    else:
        raw = completion(stop=stops, max_tokens=max_tokens, n=n, stream=True, logprobs=logprobs)
        parsed = parse_completion_request(raw, 256)
    tokens = parsed.output_cap
    expected = parsed.output_text(tokens)
    assert not any(s in expected for s in stops)
    payloads = stream_of(parsed, tokens)
    for index in range(n):
        text = streamed_text(payloads, index)
        if parsed.stop_after is not None:
            assert text == expected
        else:
            assert text == placeholder_text(tokens) and text.rstrip(" ") == expected
    token_frames = [
        p
        for p in payloads
        if p != "[DONE]" and p["choices"] and "finish_reason" not in p["choices"][0]
    ]
    opening = n if kind == "chat" else 0
    assert len(token_frames) == opening + n * tokens


def test_stream_ended_before_its_stop_sends_the_held_back_text() -> None:
    """If the engine stops a choice before its stop string completes (a drawn response
    length), the text the cut frames held back is sent before the finish frame."""
    parsed = parse_chat_request(chat(stop="of and to", max_tokens=50, stream=True), 256)
    assert parsed.stop_after == 4
    payloads = stream_of(parsed, 3, "stop")
    assert streamed_text(payloads) == "the of and "
    assert body_of(parsed, 3, "stop")["choices"][0]["message"]["content"] == "the of and"


def test_stop_point_searches_one_cycle_plus_the_stop_length() -> None:
    """The placeholder text is periodic: a long stop string is found across cycles."""
    long_stop = placeholder_text(60, start=3)  # "to in ... " spanning a cycle boundary
    point = stop_point([long_stop], 10_000)
    assert point == (63, len(placeholder_text(3)))
    assert stop_point(["would the of"], 10_000) == (52, len(placeholder_text(49)))


# -- n ----------------------------------------------------------------------------------


def test_n_choices_have_indices_and_usage_counts_them_all() -> None:
    """n = 3: three identical choices indexed 0..2; usage completion_tokens is 3 x per
    choice; the prompt counts once."""
    parsed = parse_chat_request(chat(n=3, max_tokens=4), 256)
    body = body_of(parsed, 4)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in body["choices"]} == {"the of and to"}
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 12,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    ChatCompletion.model_validate(body)
    completions = parse_completion_request(completion(n=2, max_tokens=2), 256)
    body = body_of(completions, 2)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "the of"), (1, "the of")]
    assert body["usage"]["completion_tokens"] == 4
    Completion.model_validate(body)


def test_n_streams_frames_for_every_choice() -> None:
    """A stream of n choices opens each, sends one frame per token and choice (choice
    order within a token), finishes each, then one usage frame over all choices."""
    parsed = parse_chat_request(
        chat(n=2, max_tokens=2, stream=True, stream_options={"include_usage": True}), 256
    )
    payloads = stream_of(parsed, 2)
    shape = [
        (p["choices"][0]["index"], p["choices"][0]["delta"])
        if p != "[DONE]" and p["choices"]
        else p
        for p in payloads
    ]
    assert shape[:6] == [
        (0, {"role": "assistant"}),
        (1, {"role": "assistant"}),
        (0, {"content": "the "}),
        (1, {"content": "the "}),
        (0, {"content": "of "}),
        (1, {"content": "of "}),
    ]
    assert shape[6:8] == [(0, {}), (1, {})]
    assert payloads[8]["usage"]["completion_tokens"] == 4
    assert payloads[-1] == "[DONE]"
    for p in payloads[:-1]:
        ChatCompletionChunk.model_validate(p)
    echo = parse_completion_request(completion(n=2, echo=True, stream=True), 256)
    opening = frames(StreamEncoder(echo, request_id="i", created=1).opening())
    assert [(p["choices"][0]["index"], p["choices"][0]["text"]) for p in opening] == [
        (0, "hello world"),
        (1, "hello world"),
    ]


@pytest.mark.parametrize(("n", "message"), [(0, "got 0"), (129, "got 129"), (2.0, "got 2.0")])
def test_n_out_of_range_is_400_naming_n(n: Any, message: str) -> None:
    for parse, raw in ((parse_chat_request, chat), (parse_completion_request, completion)):
        error = refusal(raw(n=n), parse)
        assert (error.status, error.param) == (400, "n") and message in error.message


def test_best_of_is_refused_unless_it_equals_n() -> None:
    """best_of would sample extra candidates: refused (400, param best_of) unless absent
    or equal to n."""
    for parse, raw in ((parse_chat_request, chat), (parse_completion_request, completion)):
        error = refusal(raw(best_of=3), parse)
        assert (error.status, error.code, error.param) == (400, "unsupported_value", "best_of")
        assert parse(raw(best_of=2, n=2), 256).n == 2
        assert parse(raw(best_of=None), 256).n == 1


# -- logprobs ---------------------------------------------------------------------------


def test_chat_logprobs_have_openais_shape_with_the_emitted_token_first() -> None:
    parsed = parse_chat_request(chat(logprobs=True, top_logprobs=3, max_tokens=2), 256)
    assert parsed.logprobs == 3
    body = body_of(parsed, 2)
    ChatCompletion.model_validate(body)
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["the ", "of "]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert top[0]["logprob"] == entry["logprob"] <= 0
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert len({t["token"] for t in top}) == 3
    assert "logprobs" not in body_of(parse_chat_request(chat(), 256), 1)["choices"][0]


def test_chat_logprobs_true_without_top_lists_no_alternatives() -> None:
    parsed = parse_chat_request(chat(logprobs=True, max_tokens=1), 256)
    entry = body_of(parsed, 1)["choices"][0]["logprobs"]["content"][0]
    assert entry["top_logprobs"] == []


def test_completions_logprobs_have_openais_shape_and_text_offsets() -> None:
    """tokens, token_logprobs, top_logprobs (emitted token first), text_offset counted
    from the start of the choice's text; with ``echo`` the prompt's own tokens come first
    (the byte rule's 4-byte pieces of "hello world"), the first with no logprob, as
    vLLM's prompt logprobs."""
    parsed = parse_completion_request(completion(logprobs=2, max_tokens=3, echo=True), 256)
    body = body_of(parsed, 3)
    # the SDK reads the body as it does a server's (its types say float where the first
    # prompt entry is null, as vLLM's and OpenAI's legacy API send it)
    read = construct_type(type_=Completion, value=body)
    assert read.choices[0].logprobs.tokens[:3] == ["hell", "o wo", "rld"]
    Completion.model_validate(body_of(parse_completion_request(completion(logprobs=2), 256), 3))
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["hell", "o wo", "rld", "the ", "of ", "and "]
    assert logprobs["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None
    top = ["o wo", "rld", "the ", "of ", "and "]
    assert [list(t)[0] for t in logprobs["top_logprobs"][1:]] == top
    assert all(len(t) == 2 for t in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == [0, 4, 8, 11, 15, 18]
    text = body["choices"][0]["text"]
    assert [text[o : o + 3] for o in logprobs["text_offset"]] == [
        "hel",
        "o w",
        "rld",
        "the",
        "of ",
        "and",
    ]
    plain = parse_completion_request(completion(logprobs=2, max_tokens=3), 256)
    assert body_of(plain, 3)["choices"][0]["logprobs"]["tokens"] == ["the ", "of ", "and "]


def test_completions_logprobs_zero_lists_the_emitted_token() -> None:
    parsed = parse_completion_request(completion(logprobs=0, max_tokens=1), 256)
    assert body_of(parsed, 1)["choices"][0]["logprobs"]["top_logprobs"] == [{"the ": -0.25}]


def test_streamed_logprobs_ride_in_each_token_frame() -> None:
    """Each token frame carries that token's logprobs; the streamed entries equal the
    non-streaming ones; completions offsets keep counting across the cycle of words."""
    parsed = parse_chat_request(
        chat(logprobs=True, top_logprobs=2, max_tokens=55, stream=True), 256
    )
    payloads = [p for p in stream_of(parsed, 55) if p != "[DONE]"]
    for p in payloads:
        ChatCompletionChunk.model_validate(p)
    entries = [
        e
        for p in payloads
        if p["choices"] and p["choices"][0].get("logprobs")
        for e in p["choices"][0]["logprobs"]["content"]
    ]
    assert entries == body_of(parsed, 55)["choices"][0]["logprobs"]["content"]
    parsed = parse_completion_request(completion(logprobs=1, max_tokens=55, stream=True), 256)
    streamed = [
        p["choices"][0]["logprobs"]
        for p in stream_of(parsed, 55)
        if p != "[DONE]" and p["choices"][0].get("logprobs")
    ]
    whole = body_of(parsed, 55)["choices"][0]["logprobs"]
    for p in streamed:
        Logprobs.model_validate(p)
    assert [o for p in streamed for o in p["text_offset"]] == whole["text_offset"]
    assert [t for p in streamed for t in p["tokens"]] == whole["tokens"]


@pytest.mark.parametrize(
    ("raw", "parse", "param"),
    [
        (chat(logprobs=True, top_logprobs=21), parse_chat_request, "top_logprobs"),
        (chat(logprobs=True, top_logprobs=-1), parse_chat_request, "top_logprobs"),
        (chat(top_logprobs=2), parse_chat_request, "top_logprobs"),
        (chat(logprobs=1), parse_chat_request, "logprobs"),
        (completion(logprobs=6), parse_completion_request, "logprobs"),
        (completion(logprobs=True), parse_completion_request, "logprobs"),
    ],
)
def test_logprob_bounds_are_400_naming_the_field(
    raw: dict[str, Any], parse: Any, param: str
) -> None:
    error = refusal(raw, parse)
    assert (error.status, error.param) == (400, param)


def test_token_frames_are_built_once_per_request() -> None:
    """The distinct frames are encoded on the first token and reused: a later run of
    the same words is byte-identical (and costs no JSON encoding)."""
    parsed = parse_chat_request(chat(n=2, logprobs=True, top_logprobs=1, stream=True), 256)
    enc = StreamEncoder(parsed, request_id="i", created=1)
    first = enc.tokens(0, 50)
    cached = enc._frames
    assert enc.tokens(50, 100) == first and enc._frames is cached


# -- hostile input ------------------------------------------------------------------------


def test_deeply_nested_json_is_400_invalid_json() -> None:
    """A body nested past the decoder's depth is a 400, not a RecursionError."""
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        with pytest.raises(ApiError) as info:
            parse_json_object(body)
        assert (info.value.status, info.value.code) == (400, "invalid_json")
        assert "nested too deeply" in info.value.message


def test_deep_tools_are_400_naming_the_field() -> None:
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    error = refusal(chat(tools=deep))
    assert (error.status, error.param) == (400, "tools")
    msgs = [{"role": "assistant", "content": "", "tool_calls": deep}]
    assert refusal(chat(messages=msgs)).param == "messages[0].tool_calls"


@pytest.mark.parametrize(
    ("raw", "parse", "param"),
    [
        (
            chat(messages=[{"role": "user", "content": "a\ud800"}]),
            parse_chat_request,
            "messages[0].content",
        ),
        (
            chat(messages=[{"role": "user", "content": [{"text": "\udfff"}]}]),
            parse_chat_request,
            "messages[0].content[0].text",
        ),
        (
            chat(messages=[{"role": "\ud800", "content": "x"}]),
            parse_chat_request,
            "messages[0].role",
        ),
        (chat(model="m\ud800"), parse_chat_request, "model"),
        (chat(stop=["\ud800"]), parse_chat_request, "stop"),
        (completion(prompt="\ud800"), parse_completion_request, "prompt"),
        (completion(prompt=["ok", "\ud800"]), parse_completion_request, "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(
    raw: dict[str, Any], parse: Any, param: str
) -> None:
    """A lone surrogate escape anywhere the server reads a string is a 400, and the
    error body (which quotes the value) still encodes."""
    error = refusal(raw, parse)
    assert (error.status, error.code, error.param) == (400, "invalid_value", param)
    assert json.loads(error.body())["error"]["param"] == param


def test_lone_surrogate_in_a_json_body_is_400_end_to_end() -> None:
    raw = parse_json_object(b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}')
    assert refusal(raw).param == "messages[0].content"
    with pytest.raises(ApiError) as info:
        parse_capacity_request(parse_json_object(b'{"model":"\\udc00"}'))
    assert (info.value.status, info.value.param) == (400, "model")


def test_error_bodies_always_encode() -> None:
    """error_body escapes what UTF-8 cannot hold; the result is valid JSON."""
    body = error_body(
        "Model 'x\ud800' not found", "invalid_request_error", "model_not_found", "model"
    )
    assert json.loads(body)["error"]["message"] == "Model 'x\ud800' not found"
    assert b"\\ud800" in body
    assert dumps({"a": "é\udfff"}) == '{"a":"é\\udfff"}'.encode()


def test_truncate_echo_caps_echoed_values() -> None:
    assert truncate_echo("short") == "short"
    long = "m" * 1_000_000
    cut = truncate_echo(long)
    assert len(cut) == 256 and cut.endswith("\u2026")
    assert truncate_echo("abcdef", limit=4) == "abc\u2026"


def test_unknown_capacity_key_is_echoed_truncated() -> None:
    with pytest.raises(ApiError) as info:
        parse_capacity_request({"k" * 10_000: 1})
    assert len(info.value.message) < 400 and len(info.value.param or "") <= 256


@pytest.mark.parametrize("field", ["max_num_seqs", "max_waiting"])
def test_capacity_values_have_an_upper_bound(field: str) -> None:
    """max_num_seqs and max_waiting above MAX_CAPACITY (10**29 included) are a 400."""
    assert getattr(parse_capacity_request({field: MAX_CAPACITY}), field) == MAX_CAPACITY
    for value in (MAX_CAPACITY + 1, 10**29):
        with pytest.raises(ApiError) as info:
            parse_capacity_request({field: value})
        assert (info.value.status, info.value.param) == (400, field)
        assert f"..{MAX_CAPACITY}" in info.value.message


def test_parse_functions_keep_their_positional_signature() -> None:
    """The serve app calls parse_*(raw, default_max_tokens); the tokenizer is a keyword."""
    assert parse_chat_request(chat(), 99).max_tokens == 99
    assert parse_completion_request(completion(), 42, tokenizer=None).prompt_tokens == 3


def test_request_ids_are_32_random_hex_digits_after_their_kind() -> None:
    ids = {new_request_id("completions") for _ in range(2000)}
    assert len(ids) == 2000
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", new_request_id("chat"))
    assert len({random_hex() for _ in range(2000)}) == 2000
