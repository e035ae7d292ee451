"""The Messages API as the official ``anthropic`` SDK uses it, on a real socket (each test
under ``trio.fail_after``, never the autojump clock): ``messages.create``,
``messages.stream`` and its final message, an agent loop of ``tool_use`` and
``tool_result`` turns that ends with an answer, ``count_tokens``, a LoRA adapter named as
the model, and a full queue raising the SDK's ``OverloadedError`` without its retries."""

from __future__ import annotations

import sys
from typing import Any

import anthropic
import attrs
import jsonschema
import pytest
import trio

from inference_lab.core.config import load_deployment
from tests.conftest import CONFIGS, GPT, chat_body, make_settings
from tests.serve_util import http_request, running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

QWEN = "Qwen3-30B-A3B"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS: Any = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]


def client_for(url: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", **kwargs)


def settings() -> Any:
    qwen = load_deployment(CONFIGS / "Qwen3-30B-A3B.toml", "b200")
    base = make_settings(run_to_max_tokens=False)
    return attrs.evolve(base, deployments=(base.deployments[0], qwen))


async def test_create_stream_and_count_tokens_through_the_sdk() -> None:
    """``create`` and ``stream`` give the SDK's ``Message`` (thinking then text on
    Qwen3), the stream's final message says what the events said, and ``count_tokens``
    counts the prompt ``create`` reported."""
    with trio.fail_after(60):
        async with running_server(settings()) as (url, _, _state):
            client = client_for(url, max_retries=0)
            messages: Any = [{"role": "user", "content": "Write a haiku"}]
            message = await client.messages.create(
                model=QWEN, max_tokens=400, system="Be brief.", messages=messages
            )
            assert [block.type for block in message.content] == ["thinking", "text"]
            assert message.stop_reason in ("end_turn", "max_tokens")
            assert message.usage.output_tokens > 0
            async with client.messages.stream(
                model=QWEN, max_tokens=400, system="Be brief.", messages=messages
            ) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "thinking" in kinds and "text" in kinds
            assert final.content[0].type == "thinking" and final.content[-1].type == "text"
            assert final.stop_reason in ("end_turn", "max_tokens")
            counted = await client.messages.count_tokens(
                model=QWEN, system="Be brief.", messages=messages
            )
            usage = message.usage
            assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
            await client.close()


async def test_an_agent_loop_calls_its_tool_and_ends_with_an_answer() -> None:
    """An agent loop with the SDK: each ``tool_use`` answered by a ``tool_result`` until
    the model answers in text (``end_turn`` or ``max_tokens``); every call's input is
    valid for the tool, and the loop ends within a few calls."""
    with trio.fail_after(120):
        async with running_server(settings()) as (url, _, _state):
            client = client_for(url, max_retries=0)
            rounds = []
            for run in range(12):
                messages: Any = [{"role": "user", "content": f"What is the weather in city {run}?"}]
                for call_round in range(1, 10):
                    reply = await client.messages.create(
                        model=GPT, max_tokens=1024, tools=TOOLS, messages=messages
                    )
                    messages.append({"role": "assistant", "content": reply.content})
                    uses = [b for b in reply.content if b.type == "tool_use"]
                    if reply.stop_reason != "tool_use":
                        assert not uses and reply.content[-1].type == "text"
                        rounds.append(call_round)
                        break
                    results = []
                    for use in uses:
                        jsonschema.validate(use.input, WEATHER)
                        results.append(
                            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
                        )
                    messages.append({"role": "user", "content": results})
            await client.close()
    assert len(rounds) == 12 and max(rounds) <= 6
    assert any(r > 1 for r in rounds)


async def test_a_full_queue_raises_the_sdks_overloaded_error_without_retries() -> None:
    """With ``max_num_seqs 1`` and ``max_waiting 1`` held by two streams, a message is a 529
    the SDK raises as ``OverloadedError`` (``type`` ``overloaded_error``); the SDK's own
    retries (``max_retries`` 2) do not run: ``x-should-retry: false``."""
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
            runtime = state.runtimes[GPT]  # (a stream's first bytes come once it is admitted)
            assert runtime.snapshot().admitted == 2
            client = client_for(url, max_retries=2)
            with pytest.raises(anthropic.OverloadedError) as raised:
                await client.messages.create(
                    model=GPT, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
                )
            assert raised.value.status_code == 529
            assert raised.value.type == "overloaded_error"
            assert runtime.snapshot().refused == 1
            await client.close()
            for stream in streams:
                await stream.aclose()


async def test_the_sdk_names_a_lora_adapter() -> None:
    """``messages.create`` and ``count_tokens`` with an adapter's name as ``model`` (as
    vLLM's Messages handler takes it, through its chat completions): the SDK's ``Message``
    names the adapter, the adapter was loaded for it, and its prompt is counted as the
    base model's; an unknown name is the SDK's ``NotFoundError``."""
    from tests.test_serve_lora import lora_settings

    with trio.fail_after(60):
        async with running_server(lora_settings()) as (url, _, state):
            client = client_for(url, max_retries=0)
            messages: Any = [{"role": "user", "content": "hello " * 20}]
            message = await client.messages.create(model="sql", max_tokens=4, messages=messages)
            assert message.model == "sql" and message.usage.output_tokens > 0
            (base,) = state.runtimes
            lora = state.runtimes[base].engine.statistics().workers[0].lora
            assert lora is not None and lora.loads == 1 and lora.resident == ("sql",)
            counted = await client.messages.count_tokens(model="sql", messages=messages)
            assert counted.input_tokens == message.usage.input_tokens
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.create(model="nope", max_tokens=4, messages=messages)
