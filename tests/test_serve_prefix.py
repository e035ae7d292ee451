"""Prefix caching on the serve side: prompts hashed after the chat template, the chain
carried into admission, ``usage.prompt_tokens_details.cached_tokens``.

The expected chains are built here from the rules of ``inference_lab/api/hashing.py``
(the byte rule's ids from ``ByteTokenizer.encode``, template tokens inserted one by one,
``traffic.hashing.token_block_hashes``), not with the module's own functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from inference_lab.api.hashing import (
    PromptHashing,
    byte_ids,
    chain_hashes,
    hash_chat,
    hash_text,
    hash_token_ids,
)
from inference_lab.api.requests import parse_chat_request, parse_completion_request
from inference_lab.api.text import placeholder_text
from inference_lab.api.tokenizer import ByteTokenizer, ChatMessage, load_tokenizer
from inference_lab.traffic.hashing import token_block_hashes

from .conftest import GPT, LLAMA, ServeFactory, make_settings
from .tokenizer_util import train_bpe, write_template

BYTE = ByteTokenizer()


def template_stream(ids: list[int]) -> list[int]:
    """Rule 3 by hand: a template token (0) after every 20 text tokens."""
    out: list[int] = []
    for j, t in enumerate(ids):
        out.append(t)
        if (j + 1) % 20 == 0:
            out.append(0)
    return out


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


@pytest.mark.parametrize("text", ["", "abc", "abcd", "héllo wörld ✓ " * 7, "x" * 1001])
def test_byte_ids_are_the_byte_rules_ids(text: str) -> None:
    assert byte_ids(text.encode()).tolist() == BYTE.encode(text)


def test_chain_hashes_equal_the_traffic_chain() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1 << 40, 1000, dtype=np.int64)
    assert chain_hashes(ids, 16, 10**9) == token_block_hashes(ids.tolist(), 16)
    assert chain_hashes(ids, 16, 7) == token_block_hashes(ids.tolist(), 16)[:7]
    assert chain_hashes(ids[:15], 16, 5) == ()


def test_remembered_blocks_give_the_same_chain_and_the_memo_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hashing Rule 6: a longer stream sharing a prefix takes the prefix's runs of 16
    blocks from the memo (no BLAKE2b call for them) and its chain is still the traffic
    chain; a run that is not whole is hashed anew; a full memo starts over."""
    from inference_lab.api import hashing

    monkeypatch.setattr(hashing, "_block_memo", {})
    monkeypatch.setattr(hashing, "BLOCK_MEMO", 96)
    ids = np.arange(1, 16 * 40 + 1, dtype=np.int64)
    assert chain_hashes(ids[: 16 * 32], 16, 32) == token_block_hashes(ids[: 16 * 32].tolist(), 16)
    calls: list[bytes] = []
    real = hashing.blake2b

    def counted(data: bytes, digest_size: int) -> Any:
        calls.append(data)
        return real(data, digest_size=digest_size)

    monkeypatch.setattr(hashing, "blake2b", counted)
    assert chain_hashes(ids, 16, 40) == token_block_hashes(ids.tolist(), 16)
    assert len(calls) == 8  # only the eight new blocks: runs 0-15 and 16-31 remembered
    assert chain_hashes(ids[: 16 * 20], 16, 20) == token_block_hashes(ids[:320].tolist(), 16)
    assert len(calls) == 8 + 4  # blocks 16-19 are not a remembered run of their own
    assert len(hashing._block_memo) == 4  # runs 0-15, 16-31, 32-39, 16-19
    chain_hashes(ids + 7, 16, 40)  # three more runs would pass 96 blocks: starts over
    assert len(hashing._block_memo) == 3


def test_byte_rule_chat_stream_is_the_rendering_with_template_tokens() -> None:
    """Rule 3: the chat stream is the default rendering's byte-rule ids followed by the
    continuation's, one template token after every 20; the prompt's part is the chat
    count long, and no block past prompt + answer is hashed."""
    messages = [ChatMessage("system", "be brief " * 30), ChatMessage("user", "hello there " * 20)]
    hashing = PromptHashing(block_size=16, max_positions=100_000)
    answer = placeholder_text(40).rstrip(" ")
    got = hash_chat(BYTE, messages, None, answer, 40, hashing)
    assert got.count == BYTE.count_chat(messages)
    rendered = "system: " + "be brief " * 30 + "\nuser: " + "hello there " * 20
    stream = template_stream(BYTE.encode(rendered + "\nassistant: " + answer))
    expected = token_block_hashes(stream, 16)[: (got.count + 40) // 16]
    assert got.hashes == expected
    raw = len(BYTE.encode(rendered))
    assert len(template_stream(BYTE.encode(rendered))) == raw + raw // 20 == got.count


def test_a_longer_conversation_starts_with_the_shorter_ones_chain() -> None:
    """What makes a resent conversation hit: turn 2's chain starts with every block of
    turn 1's prompt and answer but the last (whose last 4-byte chunk may straddle)."""
    hashing = PromptHashing(block_size=16, max_positions=100_000)
    first = [ChatMessage("user", "tell me about caches " * 12)]
    answer = placeholder_text(64).rstrip(" ")
    one = hash_chat(BYTE, first, None, answer, 64, hashing)
    second = [*first, ChatMessage("assistant", answer), ChatMessage("user", "and more " * 9)]
    two = hash_chat(BYTE, second, None, placeholder_text(8).rstrip(" "), 8, hashing)
    assert common_prefix(one.hashes, two.hashes) >= len(one.hashes) - 1
    assert len(one.hashes) - 1 > one.count // 16  # into the answer's blocks


def test_completions_text_and_token_ids_hash_the_same_stream() -> None:
    """Rule 3 for completions: a text prompt and the same prompt as byte-rule ids hash
    alike as far as the prompt goes."""
    hashing = PromptHashing(block_size=16, max_positions=100_000)
    text = "abcd" * 100
    answer = placeholder_text(16).rstrip(" ")
    as_text = hash_text(BYTE, text, answer, 16, hashing)
    as_ids = hash_token_ids(BYTE, BYTE.encode(text), answer, 16, hashing)
    assert as_text.count == as_ids.count == 100
    assert as_text.hashes[: 100 // 16] == as_ids.hashes[: 100 // 16]
    assert as_text.hashes == token_block_hashes(BYTE.encode(text + answer), 16)[:7]


def test_a_huge_max_tokens_hashes_at_most_the_models_context() -> None:
    """Hashing runs before the fit check: the answer hashed is capped at max_positions."""
    hashing = PromptHashing(block_size=16, max_positions=2048)
    text, tokens = hashing.answer(10**9, None, None)
    assert tokens == 2048 and len(text) < 20_000
    parsed = parse_completion_request(
        {"model": GPT, "prompt": "hi", "max_tokens": 10**9}, 16, hashing=hashing
    )
    assert len(parsed.block_hashes) <= (2048 + 1) // 16


def test_parsing_counts_the_same_with_and_without_hashing(tmp_path: Path) -> None:
    """Rule 4 of the request parser: hashing never changes the count usage reports."""
    hf = tmp_path / "hf"
    train_bpe(hf)
    write_template(hf)
    templated = load_tokenizer(hf)
    plain_dir = tmp_path / "plain"
    plain = load_tokenizer(train_bpe(plain_dir))
    hashing = PromptHashing(block_size=4, max_positions=10_000)
    chat = {"model": GPT, "messages": [{"role": "user", "content": "the quick brown fox " * 9}]}
    comp = {"model": GPT, "prompt": "hello world " * 11}
    for tok in (None, templated, plain):
        a = parse_chat_request(chat, 8, tokenizer=tok)
        b = parse_chat_request(chat, 8, tokenizer=tok, hashing=hashing)
        assert a.prompt_tokens == b.prompt_tokens and b.block_hashes and not a.block_hashes
        c = parse_completion_request(comp, 8, tokenizer=tok)
        d = parse_completion_request(comp, 8, tokenizer=tok, hashing=hashing)
        assert c.prompt_tokens == d.prompt_tokens and d.block_hashes


def test_a_chat_template_resend_shares_the_prompt_and_answer(tmp_path: Path) -> None:
    """Rule 2: with a template, the continuation is the answer right after the generation
    prompt, so the next turn's chain (the template renders the assistant message there)
    starts with this turn's prompt and answer blocks."""
    train_bpe(tmp_path)
    write_template(tmp_path)
    tok = load_tokenizer(tmp_path)
    hashing = PromptHashing(block_size=4, max_positions=10_000)
    first = [ChatMessage("user", "the quick brown fox jumps over the lazy dog " * 3)]
    answer = placeholder_text(30).rstrip(" ")
    one = hash_chat(tok, first, None, answer, 30, hashing)
    second = [*first, ChatMessage("assistant", answer), ChatMessage("user", "hello world")]
    two = hash_chat(tok, second, None, "the", 1, hashing)
    shared = common_prefix(one.hashes, two.hashes)
    assert shared * 4 > one.count  # past the prompt, into the answer
    assert shared >= len(one.hashes) - 1


# -- the served path ------------------------------------------------------------------------


async def chat(s: Any, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> Any:
    response = await s.post(
        "/v1/chat/completions",
        {"model": GPT, "messages": messages, "max_tokens": max_tokens, **extra},
    )
    assert response.status_code == 200
    return json.loads(await response.get_data())


def expected_hit(
    one: tuple[int, ...], two: tuple[int, ...], computed: int, p2: int, bs: int
) -> int:
    """The engine's rule: turn 1 cached the blocks its computed positions filled; turn 2
    finds the leading ones its chain shares, at most (P2 - 1) // bs blocks."""
    cached = min(computed // bs, len(one))
    return min(common_prefix(one[:cached], two), (p2 - 1) // bs) * bs


async def test_a_resent_conversation_reports_the_cached_prompt_and_answer(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Turn 2 resends turn 1's messages and answer: its usage reports as cached exactly
    the blocks the engine's rule gives for the two chains, which reach past turn 1's
    prompt into its answer; turn 1 itself reports 0."""
    async with serve(make_settings()) as s:
        bs = s.state.hashing[GPT].block_size
        first = [{"role": "user", "content": "what is a KV cache? " * 40}]
        body1 = await chat(s, first, 200)
        assert body1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        answer = body1["choices"][0]["message"]["content"]
        second = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "go on"},
        ]
        body2 = await chat(s, second, 10)
        p1, out1 = body1["usage"]["prompt_tokens"], body1["usage"]["completion_tokens"]
        p2 = body2["usage"]["prompt_tokens"]
        rendered1 = "user: " + first[0]["content"]
        full1 = template_stream(BYTE.encode(rendered1 + "\nassistant: " + answer))
        rendered2 = rendered1 + "\nassistant: " + answer + "\nuser: go on\nassistant: "
        full2 = template_stream(BYTE.encode(rendered2 + placeholder_text(10).rstrip(" ")))
        one = token_block_hashes(full1, bs)[: (p1 + 200) // bs]
        two = token_block_hashes(full2, bs)
        cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == expected_hit(one, two, p1 + out1 - 1, p2, bs)
        assert cached > (p1 // bs) * bs  # the answer's blocks hit too


async def test_streamed_usage_reports_cached_tokens(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The usage frame of a stream (stream_options.include_usage) carries
    prompt_tokens_details.cached_tokens, for chat and completions."""
    async with serve(make_settings()) as s:
        prompt = "abcd" * 300
        for path, body in (
            ("/v1/completions", {"model": GPT, "prompt": prompt, "max_tokens": 3}),
            (
                "/v1/chat/completions",
                {"model": GPT, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3},
            ),
        ):
            seen = []
            for _ in range(2):
                streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
                async with s.stream(streamed, path=path) as st:
                    await st.read_all()
                usage = [f for _, f in st.frame_times() if isinstance(f, dict) and f.get("usage")]
                seen.append(usage[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert seen[0] == 0 and seen[1] > 0 and seen[1] % 64 == 0


async def test_without_prefix_caching_nothing_is_hashed_or_cached(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A model with enable_prefix_caching off hashes nothing (Rule 5): the same request
    twice reports 0 cached tokens."""
    async with serve(make_settings(enable_prefix_caching=False)) as s:
        assert GPT not in s.state.hashing
        messages = [{"role": "user", "content": "same prompt " * 100}]
        for _ in range(2):
            body = await chat(s, messages, 4)
            assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize(("router", "hits"), [("prefix_affinity", True), ("round_robin", False)])
async def test_admission_routes_with_the_chain(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, router: str, hits: bool
) -> None:
    """The chain reaches the router at admission: with two replicas behind
    prefix_affinity the resend goes to the replica holding its blocks; round_robin sends
    it to the other one, which has nothing cached."""
    settings = make_settings(LLAMA, hardware="h100")
    dep = settings.deployments[0]
    dep = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=2, router=router))
    settings = attrs.evolve(settings, deployments=(dep,))
    async with serve(settings) as s:
        messages = [{"role": "user", "content": "route me " * 200}]
        body = {"model": LLAMA, "messages": messages, "max_tokens": 4}
        for _ in range(2):
            response = await s.post("/v1/chat/completions", body)
            data = json.loads(await response.get_data())
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 0) == hits
