"""Bounded work per request: the cap on what one request may ask for, and large
non-streaming bodies sent in pieces of bounded work."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_lab.api.encoding import PIECE_TOKENS, body_pieces, completion_body
from inference_lab.api.requests import (
    MAX_RESPONSE_WORK,
    check_work,
    parse_chat_request,
    parse_completion_request,
)
from inference_lab.errors import ApiError
from tests.conftest import GPT, ServeFactory, chat_body, make_settings


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"n": 128, "max_tokens": 1000, "logprobs": True, "top_logprobs": 20}, "chat"),
        (
            {"n": 128, "max_tokens": 1000, "logprobs": 5, "echo": True, "prompt": "x" * 4000},
            "completions",
        ),
        ({"n": 64, "max_tokens": 20_000}, "chat"),
    ],
)
def test_a_request_asking_for_too_much_is_a_400_naming_the_fields(
    body: dict[str, Any], kind: str
) -> None:
    """n x (max_tokens + echoed prompt) x (1 + logprobs) above MAX_RESPONSE_WORK is a 400
    naming n, max_tokens and the logprobs field, before anything is admitted."""
    base: dict[str, Any] = {"model": GPT}
    if kind == "chat":
        base["messages"] = [{"role": "user", "content": "x"}]
        parse = parse_chat_request
    else:
        base["prompt"] = "x"
        parse = parse_completion_request
    with pytest.raises(ApiError) as refused:
        check_work(parse({**base, **body}, 256))
    error = refused.value
    assert (error.status, error.code, error.param) == (400, "invalid_value", "max_tokens")
    assert "n (" in error.message and "max_tokens" in error.message
    assert ("top_logprobs" if kind == "chat" else "logprobs") in error.message
    assert f"{MAX_RESPONSE_WORK:,}" in error.message


def test_the_largest_allowed_request_passes() -> None:
    """Exactly MAX_RESPONSE_WORK entries is allowed; one token more is not."""
    tokens = MAX_RESPONSE_WORK // (8 * 4)
    body = {"model": GPT, "prompt": "x", "n": 8, "max_tokens": tokens, "logprobs": 3}
    assert check_work(parse_completion_request(body, 256)).max_tokens == tokens
    with pytest.raises(ApiError):
        check_work(parse_completion_request({**body, "max_tokens": tokens + 1}, 256))


async def test_the_route_refuses_too_much_work_after_the_context_check(
    serve: ServeFactory,
) -> None:
    """Through the app: a 140-byte request for 128 choices x 1,000 tokens x 21 logprobs
    is a 400 naming the fields, and nothing is admitted; a max_tokens beyond the context
    stays a context_length_exceeded."""
    async with serve(make_settings()) as s:
        body = chat_body(max_tokens=1000, n=128, logprobs=True, top_logprobs=20)
        response = await s.post("/v1/chat/completions", body)
        assert response.status_code == 400
        error = json.loads(await response.get_data())["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "max_tokens")
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=10**9))
        assert json.loads(await response.get_data())["error"]["code"] == "context_length_exceeded"
        assert s.runtime().snapshot().admitted == 0


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["chat", "completions"]),
    n=st.integers(1, 4),
    tokens=st.integers(1, 3 * PIECE_TOKENS + 7),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    echo=st.booleans(),
    stop=st.booleans(),
)
def test_body_pieces_concatenate_to_the_whole_body(
    kind: str, n: int, tokens: int, logprobs: int | None, echo: bool, stop: bool
) -> None:
    """The pieces of a body are exactly the whole body's bytes, whatever the request."""
    raw: dict[str, Any] = {"model": GPT, "n": n, "max_tokens": tokens}
    if kind == "chat":
        raw["messages"] = [{"role": "user", "content": "hé"}]
        if logprobs is not None:
            raw.update(logprobs=True, top_logprobs=logprobs)
        parsed = parse_chat_request(raw, 16)
    else:
        raw.update(prompt="prompt é", echo=echo)
        if logprobs is not None:
            raw["logprobs"] = logprobs
        if stop:
            raw["stop"] = ["and"]
        parsed = parse_completion_request(raw, 16)
    common = {"request_id": "cmpl-1", "created": 7, "completion_tokens": tokens}
    whole = completion_body(parsed, finish_reason="length", **common)
    pieces = list(body_pieces(parsed, finish_reason="length", **common))
    assert b"".join(pieces) == whole
    json.loads(whole)


async def test_a_large_non_streaming_body_is_sent_in_bounded_pieces(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A non-streaming answer of 8 choices x 6,000 tokens with 5 logprobs each is sent as
    many body messages, none holding more than PIECE_TOKENS tokens' logprobs (so none took
    long to build); together they are the JSON body."""
    async with serve(make_settings()) as s:
        body = chat_body(max_tokens=6000, n=8, logprobs=True, top_logprobs=5)
        async with s.stream(body) as st:
            chunks = [data for _, data in await st.read_all()]
        assert st.status == 200 and st.headers["content-type"] == "application/json"
        assert len(chunks) > 8 * (6000 // PIECE_TOKENS)
        per_token = max(len(c) for c in chunks) / PIECE_TOKENS
        assert per_token < 2000  # bytes per token: bounded pieces (an entry is ~600 B)
        doc = json.loads(b"".join(chunks))
        assert [c["index"] for c in doc["choices"]] == list(range(8))
        assert len(doc["choices"][3]["logprobs"]["content"]) == 6000
        assert doc["usage"]["completion_tokens"] == 8 * 6000


def test_hashing_a_request_is_bounded_by_its_prompt_not_its_max_tokens() -> None:
    """A request's hash chain (built before admission) covers at most
    MAX_ANSWER_HASH_TOKENS of its answer: one asking for 100,000 tokens is hashed like one
    asking for that many, so a burst of such requests costs no hashing storm."""
    from inference_lab.api.hashing import MAX_ANSWER_HASH_TOKENS, PromptHashing

    hashing = PromptHashing(block_size=16, max_positions=131_072)
    body = {"model": GPT, "messages": [{"role": "user", "content": "hello"}]}
    small = parse_chat_request({**body, "max_tokens": MAX_ANSWER_HASH_TOKENS}, 16, hashing=hashing)
    huge = parse_chat_request({**body, "max_tokens": 100_000}, 16, hashing=hashing)
    limit = (small.prompt_tokens + MAX_ANSWER_HASH_TOKENS) // 16
    assert len(huge.block_hashes) <= limit
    assert huge.block_hashes == small.block_hashes[: len(huge.block_hashes)]
    assert len(huge.block_hashes) >= limit - 1
