"""``/v1/completions`` as lm-eval-harness's ``local-completions`` uses it: a batch of
prompts in one body (a request each, admitted whole or not at all), ``echo`` with the
prompt's own logprobs, ``max_tokens: 0`` (the prompt scored in one prefill step); and
what vLLM refuses (``suffix``) or ignores (the legacy ``functions``, a 400 here)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from openai.types import Completion

from inference_lab.api.prompt_logprobs import prompt_entries, prompt_field, prompt_token_texts
from inference_lab.api.requests import BYTE_TOKENIZER
from inference_lab.jsonbytes import dumps
from tests.conftest import GPT, ServeFactory, chat_body, make_settings


async def post(s: Any, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, Any]:
    response = await s.post(path, body)
    return response.status_code, json.loads(await response.get_data())


def loglikelihood(choice: Any, context_tokens: int) -> tuple[float, bool]:
    """lm-eval-harness's ``local-completions`` reading of a scored prompt: the sum of the
    continuation's token logprobs (after ``context_tokens``) and whether each was the top
    entry (``is_greedy``)."""
    logprobs = choice["logprobs"]
    values = logprobs["token_logprobs"][context_tokens:]
    tops = logprobs["top_logprobs"][context_tokens:]
    tokens = logprobs["tokens"][context_tokens:]
    greedy = all(max(top, key=top.get) == token for top, token in zip(tops, tokens, strict=True))
    return sum(values), greedy


async def test_a_batch_of_token_prompts_is_scored_as_lm_eval_reads_it(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """lm-eval's loglikelihood request: token-id prompts, ``echo``, ``logprobs: 1``,
    ``max_tokens: 0``: one choice per prompt in order, each echoing its prompt with a
    logprob entry per prompt token (the first ``null``), no answer tokens, usage summing
    the prompts."""
    prompts = [list(range(10)), list(range(50, 57)), [7]]
    body = {"model": GPT, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    async with serve() as s:
        status, reply = await post(s, {**body, "temperature": 0, "seed": 1234})
    assert status == 200
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"]["prompt_tokens"] == 18 and reply["usage"]["completion_tokens"] == 0
    for choice, prompt in zip(reply["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert choice["finish_reason"] == "length"
        total, greedy = loglikelihood(choice, 1)
        assert total == -0.25 * (len(prompt) - 1) and greedy


async def test_max_tokens_zero_costs_one_prefill_step(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A scored prompt is answered when its prefill step ends -- the first token's time
    of the same prompt asked for one token -- with no token reported, streamed or not."""
    prompt = "hello world " * 30
    times = []
    for max_tokens in (0, 1):  # a server each: the second would find the prompt cached
        async with serve() as s:
            t0 = trio.current_time()
            _, reply = await post(s, {"model": GPT, "prompt": prompt, "max_tokens": max_tokens})
            times.append((trio.current_time() - t0, reply))
    (scored_at, scored), (one_at, one) = times
    async with serve() as s:
        stream_body = {"model": GPT, "prompt": prompt, "max_tokens": 0, "stream": True}
        async with s.stream(
            {**stream_body, "echo": True, "stream_options": {"include_usage": True}},
            path="/v1/completions",
        ) as stream:
            await stream.read_all()
    assert scored["choices"][0]["text"] == "" and scored["usage"]["completion_tokens"] == 0
    assert one["usage"]["completion_tokens"] == 1
    assert scored_at == pytest.approx(one_at, rel=1e-9)
    frames = [json.loads(p) for p in stream.frames()[:-1]]
    assert [f["choices"][0]["text"] for f in frames[:-1]] == [prompt, ""]
    assert frames[-2]["choices"][0]["finish_reason"] == "length"
    assert frames[-1]["usage"]["completion_tokens"] == 0


async def test_echo_with_logprobs_streams_the_prompt_entries_first(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Streamed, the echo frame carries the prompt's entries and each token frame its own;
    together they are the non-streaming choice's arrays."""
    body = {"model": GPT, "prompt": "hello world", "max_tokens": 3, "echo": True, "logprobs": 2}
    async with serve() as s:
        _, whole = await post(s, body)
        async with s.stream({**body, "stream": True}, path="/v1/completions") as stream:
            await stream.read_all()
    Completion.model_validate({**whole, "choices": []})
    frames = [json.loads(p) for p in stream.frames()[:-1]]
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for frame in frames:
        logprobs = frame["choices"][0].get("logprobs")
        if logprobs:
            for key in joined:
                joined[key].extend(logprobs[key])
    expected = whole["choices"][0]["logprobs"]
    assert joined == {key: expected[key] for key in joined}
    assert expected["tokens"][:3] == ["hell", "o wo", "rld"]


async def test_batches_are_admitted_whole_or_refused_whole(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A batch of prompts takes a seat or waiting place per prompt; when they do not all
    find one it is a 529 and none stays queued; a batch with ``n`` numbers its choices
    ``prompt x n + c``."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=2)) as s:
        runtime = s.runtime()
        async with s.stream(chat_body(max_tokens=100, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            three = {"model": GPT, "prompt": ["a", "b", "c"], "max_tokens": 2}
            status, error = await post(s, three)
            assert status == 529 and error["error"]["code"] == "queue_saturated"
            assert runtime.snapshot().queued == 0 and runtime.snapshot().refused == 1
            await running.read_all()
        status, reply = await post(s, {"model": GPT, "prompt": ["a", "b"], "max_tokens": 2, "n": 2})
    assert status == 200
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["usage"]["completion_tokens"] == 8


async def test_what_vllm_refuses_or_ignores_is_a_400_naming_it(serve: ServeFactory) -> None:
    """``suffix`` is refused as vLLM refuses it; the legacy ``functions`` /
    ``function_call``, which vLLM ignores, are a 400 naming them rather than an answer
    that calls nothing; a batch over the work cap is a 400 naming ``prompt``."""
    async with serve() as s:
        status, error = await post(s, {"model": GPT, "prompt": "x", "suffix": "y"})
        assert status == 400 and error["error"]["param"] == "suffix"
        assert error["error"]["message"] == "suffix is not currently supported"
        functions = [{"name": "f", "parameters": {"type": "object"}}]
        for key, value in (("functions", functions), ("function_call", "auto")):
            status, error = await post(s, chat_body(**{key: value}), "/v1/chat/completions")
            assert status == 400 and error["error"]["param"] == key
        huge = {"model": GPT, "prompt": ["x"] * 2000, "max_tokens": 1000, "logprobs": 5}
        status, error = await post(s, huge)
        assert status == 400 and error["error"]["param"] == "prompt"
        status, error = await post(s, {"model": GPT, "prompt": ["x"] * 2049})
        assert status == 400 and error["error"]["code"] == "invalid_prompt"


@pytest.mark.parametrize(("start", "stop"), [(0, 1), (0, 7), (1, 7), (3, 7), (7, 7)])
@pytest.mark.parametrize("top", [1, 3])
def test_a_prompt_field_piece_is_the_entries_of_that_field(start: int, stop: int, top: int) -> None:
    """The body's per-field pieces say what ``prompt_entries`` says, field by field."""
    texts = prompt_token_texts(BYTE_TOKENIZER, "The quick brown fox jumps over the lazy dog")
    assert len(texts) >= 7
    entries = list(prompt_entries(texts, top, start, stop))
    for field in range(4):
        expected = b",".join(dumps(entry[field]) for entry in entries)
        assert prompt_field(texts, top, field, start, stop) == expected
