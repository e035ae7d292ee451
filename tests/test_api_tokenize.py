"""``/tokenize`` and ``/detokenize`` (:mod:`inference_lab.api.tokenize`): vLLM's shapes,
the byte rule's reversible ids, and bodies refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inference_lab.api.tokenize import (
    detokenize_body,
    parse_detokenize_request,
    parse_tokenize_request,
    tokenize_body,
)
from inference_lab.api.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from inference_lab.errors import ApiError
from tests.tokenizer_util import TEMPLATE, train_bpe, write_template

MSG = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(train_bpe(tmp_path_factory.mktemp("bpe"), bos=True))


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("templated")
    path = train_bpe(directory, bos=True)
    write_template(directory, TEMPLATE)
    return load_tokenizer(path)


def test_tokenize_prompt_answers_vllms_shape(bpe: Tokenizer) -> None:
    """``{"count", "max_model_len", "tokens"}``; add_special_tokens (default true) adds
    the BOS."""
    request = parse_tokenize_request({"model": "m", "prompt": "hello world"})
    body = json.loads(tokenize_body(request, bpe, max_model_len=4096))
    assert list(body) == ["count", "max_model_len", "tokens"]
    assert body["tokens"] == bpe.encode("hello world")
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), 4096)
    request = parse_tokenize_request({"prompt": "hello world", "add_special_tokens": False})
    plain = json.loads(tokenize_body(request, bpe, max_model_len=1))
    assert plain["count"] == body["count"] - 1


def test_tokenize_messages_renders_the_chat(templated: Tokenizer) -> None:
    """Messages are rendered by the chat template (generation prompt on by default) and
    tokenized without adding special tokens."""
    raw = {"messages": [{"role": "user", "content": "hi"}]}
    body = json.loads(tokenize_body(parse_tokenize_request(raw), templated, max_model_len=9))
    rendered = "<s><|user|>hi\n<|assistant|>"
    assert body["tokens"] == templated.encode(rendered, add_special_tokens=False)
    raw["add_generation_prompt"] = False
    body = json.loads(tokenize_body(parse_tokenize_request(raw), templated, max_model_len=9))
    assert body["tokens"] == templated.encode("<s><|user|>hi\n", add_special_tokens=False)


def test_byte_rule_tokenize_round_trips_through_detokenize() -> None:
    """Without a tokenizer file the ids are the byte rule's reversible ids."""
    byte = ByteTokenizer()
    body = json.loads(
        tokenize_body(parse_tokenize_request({"prompt": "héllo wörld"}), byte, max_model_len=8)
    )
    assert body["count"] == 4 and len(body["tokens"]) == 4
    back = detokenize_body(parse_detokenize_request({"tokens": body["tokens"]}), byte)
    assert json.loads(back) == {"prompt": "héllo wörld"}


def test_detokenize_answers_the_text(bpe: Tokenizer) -> None:
    ids = bpe.encode("the lazy dog", add_special_tokens=False)
    body = detokenize_body(parse_detokenize_request({"model": "m", "tokens": ids}), bpe)
    assert json.loads(body) == {"prompt": "the lazy dog"}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "x", "messages": MSG}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)
def test_bad_tokenize_bodies_are_400_naming_the_field(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_tokenize_request(raw)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("raw", "param"),
    [({}, "tokens"), ({"tokens": [1, "a"]}, "tokens[1]"), ({"tokens": [-1]}, "tokens[0]")],
)
def test_bad_detokenize_bodies_are_400_naming_the_field(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_detokenize_request(raw)
    assert (info.value.status, info.value.param) == (400, param)


def test_detokenize_of_unknown_ids_is_a_400(bpe: Tokenizer) -> None:
    for tok, ids in ((bpe, [bpe.vocab_size + 3]), (ByteTokenizer(), [7])):
        with pytest.raises(ApiError) as info:
            detokenize_body(parse_detokenize_request({"tokens": ids}), tok)
        assert (info.value.status, info.value.param) == (400, "tokens")
