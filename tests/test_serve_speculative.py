"""Serving a speculative model: each engine step's tokens leave when the step ends, as one
delta per choice (vLLM's framing of a spec-decode step), paced exactly on the autojump
MockClock; the KV blocks of each verify's lookahead are held meanwhile; ``/metrics``
carries vLLM's speculative-decoding counters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from inference_lab.api.encoding import StreamEncoder
from inference_lab.api.requests import ParsedRequest, parse_chat_request, parse_completion_request
from inference_lab.api.text import placeholder_text
from inference_lab.core.config import load_deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.core.engine import stepping as engine_module
from inference_lab.core.speculative import FixedAcceptance
from inference_lab.serve import ServeSettings
from tests.conftest import ServeFactory

ROOT = Path(__file__).resolve().parent.parent
EAGLE_FILE = ROOT / "configs" / "frontier" / "Llama-3.1-8B-Instruct-EAGLE.toml"
EAGLE = "Llama-3.1-8B-Instruct-EAGLE"
PATTERN = [3, 0, 2, 1]


def frames(data: bytes) -> list[Any]:
    out: list[Any] = []
    for event in data.split(b"\n\n"):
        if event:
            payload = event[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------------------------------
# the encoder's multi-token frames


def parsed_requests() -> Iterator[tuple[str, ParsedRequest]]:
    chat: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    text: dict[str, Any] = {"model": "m", "prompt": "hi"}
    cases: list[tuple[str, dict[str, Any], bool]] = [
        ("chat", chat, True),
        ("chat n=2 logprobs", {**chat, "n": 2, "logprobs": True, "top_logprobs": 2}, True),
        ("chat stop", {**chat, "stop": ["in a"]}, True),
        ("completions", text, False),
        ("completions echo logprobs", {**text, "echo": True, "logprobs": 2}, False),
        ("completions n=3 stop", {**text, "n": 3, "stop": [" for"]}, False),
    ]
    for name, body, is_chat in cases:
        raw = {**body, "max_tokens": 12, "stream": True}
        parse = parse_chat_request if is_chat else parse_completion_request
        yield name, parse(raw, 16)


def choices(payloads: list[Any]) -> dict[int, tuple[str, list[Any]]]:
    """Per choice: its streamed text and its logprobs entries (content entries for chat,
    (token, logprob, top, offset) rows for completions), in order."""
    out: dict[int, tuple[str, list[Any]]] = {}
    for p in payloads:
        if p == "[DONE]" or not p["choices"]:
            continue
        for c in p["choices"]:
            text, probs = out.get(c["index"], ("", []))
            text += c["delta"].get("content", "") if "delta" in c else c["text"]
            lp = c.get("logprobs")
            if lp:
                if "content" in lp:
                    probs = probs + lp["content"]
                else:
                    rows = zip(
                        lp["tokens"],
                        lp["token_logprobs"],
                        lp["top_logprobs"],
                        lp["text_offset"],
                        strict=True,
                    )
                    probs = probs + [list(r) for r in rows]
            out[c["index"]] = (text, probs)
    return out


@pytest.mark.parametrize(("name", "parsed"), list(parsed_requests()))
def test_a_run_of_tokens_is_one_frame_per_choice_with_their_joined_text(
    name: str, parsed: ParsedRequest
) -> None:
    """Written in runs of 1, 4, 1, 3, 2 and a last 1 (as a verify step emits them; a stop
    string ends the stream at its token), a multi-token stream sends one frame per choice
    per run; per choice, the texts and logprobs concatenate to exactly those of the
    one-frame-per-token stream."""
    end = parsed.stop_after if parsed.stop_after is not None else 12
    runs = [(a, min(b, end)) for a, b in [(0, 1), (1, 5), (5, 6), (6, 9), (9, 11), (11, 12)]]
    runs = [(a, b) for a, b in runs if a < b]
    single = StreamEncoder(parsed, request_id="x", created=1)
    multi = StreamEncoder(parsed, request_id="x", created=1, multi_token=True)
    one = b"".join(single.tokens(a, b, final=b == end) for a, b in runs)
    joined = [multi.tokens(a, b, final=b == end) for a, b in runs]
    for (a, b), data in zip(runs, joined, strict=True):
        assert len(frames(data)) == parsed.n, (name, a, b)
    assert choices(frames(b"".join(joined))) == choices(frames(one)), name


def test_a_single_token_run_is_the_one_token_frame() -> None:
    """A run of one token is encoded exactly as a one-frame-per-token stream encodes it."""
    for _, parsed in parsed_requests():
        single = StreamEncoder(parsed, request_id="x", created=1)
        multi = StreamEncoder(parsed, request_id="x", created=1, multi_token=True)
        for i in range(12):
            assert multi.tokens(i, i + 1, final=i == 11) == single.tokens(i, i + 1, final=i == 11)


# ---------------------------------------------------------------------------------------
# serving on the MockClock


def eagle_settings() -> ServeSettings:
    return ServeSettings(deployments=(load_deployment(EAGLE_FILE, "h200"),), default_max_tokens=64)


@pytest.fixture
def fixed_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine built draws PATTERN (3, 0, 2, 1, repeated) instead of its seeded rates."""
    monkeypatch.setattr(
        engine_module, "RateAcceptance", lambda rates, seed: FixedAcceptance(PATTERN)
    )


async def test_a_stream_carries_each_verify_steps_tokens_in_one_delta_at_its_end(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, fixed_acceptance: None
) -> None:
    """max_tokens 12, gamma 3, accepted 3, 0, 2, then 1 of the 2 drafts that fit under
    max_tokens: the content frames carry 1, 4, 1, 3, 2 and 1 tokens, each leaving at its
    step's end exactly as a bare engine with the same draws times it. When each frame
    arrives the next verify's lookahead is held: ceil((P + output - 1 + width) / 16)
    blocks, width = 1 + min(3, 12 - output - 1). The texts join to the answer's."""
    dep = eagle_settings().deployments[0]
    async with serve(eagle_settings()) as s:
        rt = s.runtime(EAGLE)
        body = {
            "model": EAGLE,
            "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = trio.current_time()
        seen: list[tuple[float, str, int]] = []
        async with s.stream(body) as stream:
            while (data := await stream.next_chunk()) is not None:
                used = rt.engine.statistics().kv_used_blocks
                for p in frames(data):
                    if p == "[DONE]" or not p["choices"]:
                        continue
                    content = p["choices"][0]["delta"].get("content")
                    if content:
                        seen.append((trio.current_time() - t0, content, used))
        usage = next(p for p in frames(stream.body_bytes()) if p != "[DONE]" and p.get("usage"))
    prompt = usage["usage"]["prompt_tokens"]
    counts = [len(text.split()) for _, text, _ in seen]
    assert counts == [1, 4, 1, 3, 2, 1]
    assert "".join(text for _, text, _ in seen) == placeholder_text(12).rstrip(" ")
    oracle = Engine(dep, acceptance=FixedAcceptance(PATTERN))
    rid = oracle.submit(RequestSpec(prompt_tokens=prompt, max_tokens=12))
    times = []
    while oracle.next_event_time() is not None:
        ev = oracle.step()
        if dict(ev.tokens).get(rid):
            times.append(ev.time)
    assert [t for t, _, _ in seen] == [pytest.approx(t, rel=1e-12, abs=1e-12) for t in times]
    expected_blocks = []
    output = 0
    for count in counts:
        output += count
        if output == 12:
            expected_blocks.append(0)  # the last token: everything freed
            break
        width = 1 + min(3, 12 - output - 1)
        expected_blocks.append(math.ceil((prompt + output - 1 + width) / 16))
    assert [used for _, _, used in seen] == expected_blocks


async def test_metrics_count_drafts_draft_tokens_and_accepted_tokens(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, fixed_acceptance: None
) -> None:
    """The stream above drafts 4 times (3 + 3 + 3 + 2 = 11 draft tokens) and accepts 3 + 0
    + 2 + 1 = 6: position 0 accepted in 3 drafts, 1 in 2, 2 in 1 (vLLM's names, labels
    model_name and engine)."""
    async with serve(eagle_settings()) as s:
        body = {
            "model": EAGLE,
            "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": 12,
        }
        response = await s.post("/v1/chat/completions", body)
        assert response.status_code == 200
        text = (await (await s.client.get("/metrics")).get_data()).decode()
    labels = f'engine="0",model_name="{EAGLE}"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 4.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 11.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 6.0" in text
    for position, count in enumerate((3, 2, 1)):
        line = (
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{position}"}}'
            f" {count:.1f}"
        )
        assert line in text, line


async def test_a_model_without_speculation_exports_no_speculative_counters(
    serve: ServeFactory,
) -> None:
    async with serve() as s:
        text = (await (await s.client.get("/metrics")).get_data()).decode()
    assert "spec_decode" not in text
