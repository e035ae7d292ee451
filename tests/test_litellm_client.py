"""litellm (the SDK) as a client of ``serve`` on a real socket, each test under
``trio.fail_after``: chat streamed and not through its ``hosted_vllm`` provider, sync
and ``acompletion``; completions and the Responses API; tool calls (``required`` and an
``auto`` agent loop that ends with an answer); reasoning as litellm surfaces it
(``reasoning_content``, also when the server sends only vLLM's ``reasoning``); the
Messages API through its ``anthropic`` provider and its ``anthropic.messages``
interface; embeddings; rerank through its ``hosted_vllm``, ``cohere`` and ``jina_ai``
providers; and a 529 as litellm raises it.

litellm is not a test extra (it is part of the ``clients`` extra: ``make test-clients``),
so the module skips where it is absent. litellm's sync client blocks and its async one
runs on asyncio, so each call runs in a worker thread (``trio.to_thread``) while the
server runs on this thread's trio loop. What litellm sent is read back from its own
logging hook (``complete_input_dict``), so each test also says which route and body
shape it exercised.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import httpx
import jsonschema
import pytest
import trio

from inference_lab.core.config import load_deployment
from tests.conftest import CONFIGS, GPT, chat_body, make_settings
from tests.serve_util import http_request, running_server

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets"),
    # litellm's own pydantic models warn on import and on use
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

# (before the import: litellm would fetch its model cost map from GitHub)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip(
    "litellm",
    reason="litellm is not installed: `make test-clients` runs this file with the clients extra",
)
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402

T = TypeVar("T")
QWEN = "Qwen3-30B-A3B"
RERANKER = "Qwen3-Reranker-0.6B"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": WEATHER,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
    "required": ["city", "celsius"],
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


class Sent(CustomLogger):
    """litellm's own record of each request it made: (URL, body)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def log_pre_api_call(self, model: Any, messages: Any, kwargs: Any) -> None:
        extra = kwargs.get("additional_args") or {}
        self.requests.append((str(extra.get("api_base")), dict(extra.get("complete_input_dict"))))


@contextmanager
def recording() -> Iterator[Sent]:
    sent = Sent()
    litellm.callbacks = [sent]
    try:
        yield sent
    finally:
        litellm.callbacks = []


async def in_thread(call: Callable[[], T]) -> T:
    """``call()`` in a worker thread: litellm's sync client blocks, and the server answers
    on this thread's loop."""
    return await trio.to_thread.run_sync(call)


def settings(run_to_max_tokens: bool = False, **kwargs: Any) -> Any:
    """gpt-oss-20b, Qwen3-30B-A3B (a reasoning model) and the reranker (a pooling model),
    prose lengths drawn as ``inference-lab serve`` draws them unless ``run_to_max_tokens``;
    ``kwargs`` are other serve settings."""
    qwen = load_deployment(CONFIGS / f"{QWEN}.toml", "b200")
    reranker = load_deployment(CONFIGS / "pooling" / f"{RERANKER}.toml", "b200")
    base = make_settings(run_to_max_tokens=run_to_max_tokens)
    return attrs.evolve(
        base,
        deployments=(base.deployments[0], qwen, reranker),
        pooling_models=frozenset({RERANKER}),
        **kwargs,
    )


def vllm(url: str, model: str) -> dict[str, Any]:
    return {"model": f"hosted_vllm/{model}", "api_base": f"{url}/v1", "api_key": "unused"}


async def test_chat_streamed_and_not_sync_and_async() -> None:
    """Non-streamed and streamed (rebuilt by litellm's ``stream_chunk_builder``) give the
    same answer and usage, sync and through ``acompletion``; litellm posts to
    ``/v1/chat/completions``."""
    with trio.fail_after(60), recording() as sent:
        async with running_server(settings(run_to_max_tokens=True)) as (url, _, _state):
            params = {**vllm(url, GPT), "messages": ASK, "max_tokens": 20}
            plain = await in_thread(lambda: litellm.completion(**params))
            chunks = await in_thread(
                lambda: list(
                    litellm.completion(
                        **params, stream=True, stream_options={"include_usage": True}
                    )
                )
            )

            async def through_asyncio() -> tuple[Any, list[Any]]:
                answer = await litellm.acompletion(**params)
                stream = await litellm.acompletion(**params, stream=True)
                return answer, [chunk async for chunk in stream]

            async_plain, async_chunks = await in_thread(lambda: asyncio.run(through_asyncio()))
    assert plain.choices[0].finish_reason == "length"  # (runs to max_tokens here)
    assert plain.usage.completion_tokens == 20 and plain.usage.prompt_tokens > 0
    text = plain.choices[0].message.content
    assert len(text.split()) == 20
    built = litellm.stream_chunk_builder(chunks)
    assert built.choices[0].message.content == text
    assert built.choices[0].finish_reason == "length"
    assert built.usage.completion_tokens == 20
    assert async_plain.choices[0].message.content == text
    streamed = "".join(c.choices[0].delta.content or "" for c in async_chunks if c.choices)
    assert streamed == text
    urls = {u for u, _ in sent.requests}
    assert urls == {f"{url}/v1/chat/completions"}
    assert sent.requests[1][1]["stream"] is True


async def test_tool_calls_required_and_an_auto_agent_loop() -> None:
    """``tool_choice: required`` gives a call valid for the tool, streamed and not; with
    ``auto`` an agent loop that sends litellm's own assistant message and a ``tool``
    message back ends with an answer within a few calls; a ``response_format`` schema
    gives valid JSON."""
    with trio.fail_after(120), recording() as sent:
        async with running_server(settings()) as (url, _, _state):
            base = {**vllm(url, GPT), "tools": TOOLS}
            forced = await in_thread(
                lambda: litellm.completion(**base, messages=ASK, tool_choice="required")
            )
            chunks = await in_thread(
                lambda: list(
                    litellm.completion(**base, messages=ASK, tool_choice="required", stream=True)
                )
            )
            structured = await in_thread(
                lambda: litellm.completion(**vllm(url, GPT), messages=ASK, response_format=SCHEMA)
            )
            rounds = []
            for run in range(6):
                messages: list[Any] = [
                    {"role": "user", "content": f"What is the weather in city {run}?"}
                ]
                for call_round in range(1, 10):
                    reply = await in_thread(
                        lambda m=messages: litellm.completion(
                            **base, messages=m, tool_choice="auto", max_tokens=512
                        )
                    )
                    message = reply.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if reply.choices[0].finish_reason != "tool_calls":
                        assert not message.tool_calls and message.content
                        rounds.append(call_round)
                        break
                    for call in message.tool_calls:
                        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
                        )
    assert forced.choices[0].finish_reason == "tool_calls"
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    built = litellm.stream_chunk_builder(chunks)
    assert built.choices[0].finish_reason == "tool_calls"
    assert built.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    jsonschema.validate(json.loads(structured.choices[0].message.content), CITY)
    assert len(rounds) == 6 and max(rounds) <= 6 and any(r > 1 for r in rounds)
    assert sent.requests[0][1]["tool_choice"] == "required"
    assert any(m["role"] == "tool" for _, body in sent.requests for m in body["messages"])


async def test_reasoning_as_litellm_surfaces_it() -> None:
    """On Qwen3, litellm gives ``reasoning_content`` (non-streamed, streamed and in
    ``usage``'s ``reasoning_tokens``) also from a server that sends only vLLM's
    ``reasoning``; litellm's assistant message with its reasoning goes back in the next
    turn."""
    for reasoning_content in (True, False):
        with trio.fail_after(60), recording() as sent:
            async with running_server(settings(reasoning_content=reasoning_content)) as (
                url,
                _,
                _state,
            ):
                params = {**vllm(url, QWEN), "messages": ASK, "max_tokens": 400}
                reply = await in_thread(lambda p=params: litellm.completion(**p))
                chunks = await in_thread(
                    lambda p=params: list(litellm.completion(**p, stream=True))
                )
                message = reply.choices[0].message
                again = [*ASK, message.model_dump(exclude_none=True), ASK[0]]
                follow = await in_thread(
                    lambda p=params, m=again: litellm.completion(**{**p, "messages": m})
                )
        assert message.reasoning_content and message.content
        details = reply.usage.completion_tokens_details
        assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
        thought = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
        )
        said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert thought and said
        assert follow.choices[0].message.reasoning_content
        assert "reasoning_content" in sent.requests[-1][1]["messages"][1]


async def test_messages_api_through_the_anthropic_provider() -> None:
    """litellm's ``anthropic`` provider pointed at the server posts to ``/v1/messages``:
    text, thinking on Qwen3 (``reasoning_content`` and ``thinking_blocks``), streamed and
    not; tool use with ``tool_choice`` required, and a loop whose ``tool`` messages
    litellm turns into ``tool_result`` blocks; ``litellm.anthropic.messages.acreate``
    returns the Messages body itself; ``thinking`` disabled and a ``response_format``
    (which litellm sends as a forced tool) are honoured."""
    with trio.fail_after(120), recording() as sent:
        async with running_server(settings()) as (url, _, _state):
            anthropic = {"api_base": url, "api_key": "unused"}
            thought = await in_thread(
                lambda: litellm.completion(
                    model=f"anthropic/{QWEN}", messages=ASK, max_tokens=400, **anthropic
                )
            )
            chunks = await in_thread(
                lambda: list(
                    litellm.completion(
                        model=f"anthropic/{QWEN}",
                        messages=ASK,
                        max_tokens=400,
                        stream=True,
                        **anthropic,
                    )
                )
            )
            tools = {"model": f"anthropic/{GPT}", "tools": TOOLS, "max_tokens": 512, **anthropic}
            forced = await in_thread(
                lambda: litellm.completion(messages=ASK, tool_choice="required", **tools)
            )
            message = forced.choices[0].message
            results = [
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
                for call in message.tool_calls
            ]
            turn = [*ASK, message.model_dump(exclude_none=True), *results]
            answer = await in_thread(lambda: litellm.completion(messages=turn, **tools))
            no_thinking = await in_thread(
                lambda: litellm.completion(
                    model=f"anthropic/{QWEN}",
                    messages=ASK,
                    max_tokens=400,
                    thinking={"type": "disabled"},
                    allowed_openai_params=["thinking"],  # (litellm knows no such model)
                    **anthropic,
                )
            )
            structured = await in_thread(
                lambda: litellm.completion(
                    model=f"anthropic/{GPT}", messages=ASK, response_format=SCHEMA, **anthropic
                )
            )
            body = await in_thread(
                lambda: asyncio.run(
                    litellm.anthropic.messages.acreate(
                        model=f"anthropic/{QWEN}", messages=ASK, max_tokens=400, **anthropic
                    )
                )
            )
    assert thought.choices[0].message.reasoning_content and thought.choices[0].message.content
    assert thought.choices[0].message.thinking_blocks[0]["type"] == "thinking"
    assert thought.choices[0].finish_reason in ("stop", "length")
    assert thought.usage.completion_tokens_details.reasoning_tokens > 0
    streamed_thought = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
    )
    assert streamed_thought and "".join(c.choices[0].delta.content or "" for c in chunks)
    assert forced.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)
    assert answer.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert not getattr(no_thinking.choices[0].message, "reasoning_content", None)
    assert no_thinking.choices[0].message.content
    assert sent.requests[4][1]["thinking"] == {"type": "disabled"}
    # (litellm asks for the schema as a forced tool and hands its input back as the text)
    jsonschema.validate(json.loads(structured.choices[0].message.content), CITY)
    assert sent.requests[5][1]["tool_choice"]["type"] == "tool"
    assert body["type"] == "message"
    assert [block["type"] for block in body["content"]] == ["thinking", "text"]
    assert {u for u, _ in sent.requests} == {f"{url}/v1/messages"}
    loop_body = sent.requests[3][1]
    assert loop_body.get("tool_choice", {"type": "auto"}) == {"type": "auto"}
    blocks = [
        b for m in loop_body["messages"] if isinstance(m["content"], list) for b in m["content"]
    ]
    assert {"tool_use", "tool_result"} <= {b["type"] for b in blocks}


async def test_cached_prompt_tokens_as_litellm_reports_them() -> None:
    """A long system prompt sent twice: litellm's ``usage`` counts the whole prompt both
    times and reports the prefix cache's hit on the second, through ``anthropic/``
    (``cache_read_input_tokens``, which litellm adds back into ``prompt_tokens``) and
    ``hosted_vllm/`` (``cached_tokens``)."""
    system = " ".join(f"rule{i}" for i in range(600))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    with trio.fail_after(60):
        async with running_server(settings()) as (url, _, _state):
            replies = []
            for params in (
                {"model": f"anthropic/{GPT}", "api_base": url, "api_key": "unused"},
                vllm(url, GPT),
            ):
                for _ in range(2):
                    replies.append(
                        await in_thread(
                            lambda p=params: litellm.completion(
                                **p, messages=messages, max_tokens=5
                            )
                        )
                    )
    first, again, chat_first, chat_again = (reply.usage for reply in replies)
    assert first.prompt_tokens == again.prompt_tokens > 600
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.cache_read_input_tokens == again.prompt_tokens_details.cached_tokens
    assert again.cache_read_input_tokens < again.prompt_tokens
    # (the chat route renders the conversation as the Messages route did: found cached)
    assert chat_first.prompt_tokens == chat_again.prompt_tokens == first.prompt_tokens
    assert chat_again.prompt_tokens_details.cached_tokens == again.cache_read_input_tokens


async def test_embeddings_and_rerank_through_their_providers() -> None:
    """``litellm.embedding`` (``hosted_vllm``) gives unit vectors of the model's width;
    ``litellm.rerank`` through ``hosted_vllm`` (``/v1/rerank``), ``cohere``
    (``/v2/rerank``) and ``jina_ai`` gives the server's own ranking and scores."""
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "Tokyo is big."]
    query = "What is the capital of France?"
    with trio.fail_after(60), recording() as sent:
        async with running_server(settings()) as (url, _, state):
            vectors = await in_thread(
                lambda: litellm.embedding(**vllm(url, GPT), input=["a b c", "d e f"])
            )
            reranked = {}
            for provider, base in (
                ("hosted_vllm", f"{url}/v1"),
                ("cohere", url),
                ("jina_ai", f"{url}/v1"),
            ):
                reranked[provider] = await in_thread(
                    lambda p=provider, b=base: litellm.rerank(
                        model=f"{p}/{RERANKER}",
                        api_base=b,
                        api_key="unused",
                        query=query,
                        documents=documents,
                        top_n=3,
                    )
                )
            direct = await trio.to_thread.run_sync(
                lambda: httpx.post(
                    f"{url}/v1/rerank",
                    json={"model": RERANKER, "query": query, "documents": documents},
                ).json()
            )
            admitted = state.runtimes[GPT].snapshot().admitted
    assert [len(d["embedding"]) for d in vectors.data] == [2880, 2880]
    for item in vectors.data:
        assert sum(x * x for x in item["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert vectors.usage.prompt_tokens == 4 and admitted == 2
    order = [r["index"] for r in direct["results"]]
    scores = [r["relevance_score"] for r in direct["results"]]
    assert order[0] == 0
    for provider, answer in reranked.items():
        assert [r["index"] for r in answer.results] == order, provider
        assert [r["relevance_score"] for r in answer.results] == pytest.approx(scores), provider
    assert [u for u, _ in sent.requests] == [
        f"{url}/v1/embeddings",
        f"{url}/v1/rerank",
        f"{url}/v2/rerank",
        f"{url}/v1/rerank",
    ]


async def test_completions_and_responses_through_litellm() -> None:
    """``litellm.text_completion`` posts a batch of prompts (one choice each) and a
    scoring request (``echo`` with ``logprobs``, ``max_tokens`` 0: the prompt's own
    logprobs, the first ``None``) to ``/v1/completions``; ``litellm.responses`` reaches
    ``/v1/responses``, streamed and not (litellm raises a ``max_output_tokens`` below 16
    to 16, so 20 here)."""
    with trio.fail_after(60), recording() as sent:
        async with running_server(settings(run_to_max_tokens=True)) as (url, _, _state):
            params = vllm(url, GPT)
            batch = await in_thread(
                lambda: litellm.text_completion(**params, prompt=["a b", "c d"], max_tokens=5)
            )
            scored = await in_thread(
                lambda: litellm.text_completion(
                    **params, prompt="a b c", max_tokens=0, echo=True, logprobs=1
                )
            )
            response = await in_thread(
                lambda: litellm.responses(**params, input="hello", max_output_tokens=20)
            )
            events = await in_thread(
                lambda: list(
                    litellm.responses(**params, input="hello", max_output_tokens=20, stream=True)
                )
            )
    assert [c.index for c in batch.choices] == [0, 1]
    assert all(len(c.text.split()) == 5 and c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.completion_tokens == 10
    assert scored.choices[0].text == "a b c"
    logprobs = scored.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) > 1
    assert all(x is not None for x in logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    assert response.status == "incomplete"  # (the answer ran to max_output_tokens)
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 20 and len(response.output_text.split()) == 20
    assert events[0].type == "response.created"
    final = events[-1].response  # (litellm names the server's response.incomplete so)
    assert final.status == "incomplete" and final.usage.output_tokens == 20
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output[0].content[0].text == response.output_text
    assert sent.requests[1][1]["extra_body"] == {"echo": True} or sent.requests[1][1]["echo"]
    assert [u for u, _ in sent.requests][2:] == [f"{url}/v1/responses"] * 2


async def test_a_529_as_litellm_raises_it() -> None:
    """A full queue's 529 reaches litellm's caller as ``APIError`` with ``status_code``
    529 through ``hosted_vllm``, and through ``anthropic/`` as the ``InternalServerError``
    litellm makes of Anthropic's ``overloaded_error`` (``status_code`` 500,
    ``provider_status_code`` 529); the server counts one
    refusal per call (litellm does not retry them)."""
    with trio.fail_after(60):
        held = make_settings(max_num_seqs=1, max_waiting=1)
        async with running_server(held) as (url, port, state):
            streams = []
            for _ in range(2):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                request = chat_body(max_tokens=100_000, stream=True)
                await stream.send_all(http_request("POST", "/v1/chat/completions", request))
                await stream.receive_some(65536)
                streams.append(stream)
            runtime = state.runtimes[GPT]
            assert runtime.snapshot().admitted == 2
            raised = []
            for params, kind in (
                ({**vllm(url, GPT), "max_retries": 0}, litellm.exceptions.APIError),
                (
                    {"model": f"anthropic/{GPT}", "api_base": url, "api_key": "unused"},
                    litellm.exceptions.InternalServerError,
                ),
            ):
                with pytest.raises(kind) as caught:
                    await in_thread(
                        lambda p=params: litellm.completion(**p, messages=ASK, max_tokens=10)
                    )
                raised.append(caught.value)
            refused = runtime.snapshot().refused
            for stream in streams:
                await stream.aclose()
    assert raised[0].status_code == 529
    # (litellm's anthropic mapping knows an overload by its envelope's type)
    assert raised[1].status_code == 500 and raised[1].provider_status_code == 529
    assert "overloaded_error" in str(raised[1])
    assert refused == 2
