"""The Anthropic Messages API in memory (``docs/agents.md``): the ``message`` object and its
stream of events checked against the ``anthropic`` SDK's own types and accumulator,
tools, thinking, stop sequences, ``count_tokens``, prefix caching, pacing, and the
admission contract in Anthropic's envelope (a full queue is a 529 ``overloaded_error``).
Time-dependent tests run on the autojump MockClock."""

from __future__ import annotations

import json
from typing import Any

import attrs
import jsonschema
import pytest
import trio
import trio.testing
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from inference_lab.api.agents import split_pieces
from inference_lab.api.text import placeholder_text
from inference_lab.core.config import load_deployment
from inference_lab.serve import ServeSettings
from tests.conftest import CONFIGS, GPT, ServeFactory, Stream, chat_body, make_settings

QWEN = "Qwen3-30B-A3B"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]


def body(content: Any = "hello world", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": GPT,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def create(
    s: Any, request: dict[str, Any], path: str = "/v1/messages", headers: Any = None
) -> tuple[int, Any, Any]:
    response = await s.client.post(path, json=request, headers=headers or {})
    return response.status_code, json.loads(await response.get_data()), response.headers


def events(stream: Stream) -> list[dict[str, Any]]:
    """The stream's events, each ``event: <type>`` then ``data: <json>`` of that type."""
    data = stream.body_bytes()
    assert data.endswith(b"\n\n")
    out = []
    for block in data[:-2].split(b"\n\n"):
        head, _, payload = block.partition(b"\n")
        assert head.startswith(b"event: ") and payload.startswith(b"data: ")
        event = json.loads(payload[len(b"data: ") :])
        assert event["type"] == head[len(b"event: ") :].decode()
        out.append(event)
    return out


def rebuild(stream: Stream) -> Message:
    """The anthropic SDK's accumulator fed every event: the message it builds."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events(stream):
        typed = construct_type(type_=RawMessageStreamEvent, value=event)
        snapshot = accumulate_event(event=typed, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def qwen_settings() -> ServeSettings:
    qwen = load_deployment(CONFIGS / "Qwen3-30B-A3B.toml", "b200")
    return attrs.evolve(make_settings(), deployments=(make_settings().deployments[0], qwen))


async def test_a_message_is_the_sdks_message_with_usage(serve: ServeFactory) -> None:
    """A prose answer: one text block, ``end_turn`` or ``max_tokens``, usage with the
    prompt (as chat counts it), the output and the cache fields; valid as the SDK's
    ``Message``."""
    async with serve() as s:
        status, message, headers = await create(s, body(max_tokens=5))
        _, chat, _ = await create(s, chat_body(max_tokens=5), path="/v1/chat/completions")
    assert status == 200 and headers["content-type"] == "application/json"
    Message.model_validate(message)
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": placeholder_text(5).rstrip(" ")}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("max_tokens", None)
    assert message["usage"] == {
        "input_tokens": chat["usage"]["prompt_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 5,
    }


async def test_system_tool_results_and_tool_use_are_counted_as_chat(serve: ServeFactory) -> None:
    """``system``, a ``tool_use`` block and its ``tool_result`` count as the chat messages
    they stand for; ``count_tokens`` counts the same prompt and admits nothing."""
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "image", "source": {"type": "base64", "data": "xx"}},
            ],
        },
    ]
    chat_messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    request = {**body(), "system": "be brief", "messages": conversation, "tools": TOOLS}
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER,
                "description": "Weather for a city",
            },
        }
    ]
    async with serve() as s:
        _, message, _ = await create(s, {**request, "tool_choice": {"type": "none"}})
        _, counted, _ = await create(s, request, path="/v1/messages/count_tokens")
        chat = {**chat_body(max_tokens=8), "messages": chat_messages, "tools": chat_tools}
        _, chat_answer, _ = await create(s, chat, path="/v1/chat/completions")
        admitted = s.runtime().snapshot().admitted
    assert counted == {"input_tokens": message["usage"]["input_tokens"]}
    assert counted["input_tokens"] == chat_answer["usage"]["prompt_tokens"]
    assert admitted == 2  # count_tokens admitted nothing


async def test_tool_use_blocks_validate_and_stop_with_tool_use(serve: ServeFactory) -> None:
    """``tool_choice: any`` answers with ``tool_use`` blocks whose ``input`` validates
    against the tool's ``input_schema``; a named tool is called alone with
    ``disable_parallel_tool_use``; ``stop_reason`` is ``tool_use``; a budget that cuts the
    call ends ``max_tokens``."""
    async with serve() as s:
        for i in range(5):
            request = body(f"question {i}", max_tokens=200, tools=TOOLS)
            _, message, _ = await create(s, {**request, "tool_choice": {"type": "any"}})
            Message.model_validate(message)
            assert message["stop_reason"] == "tool_use"
            (call,) = message["content"]
            assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
            jsonschema.validate(call["input"], WEATHER)
            arguments = json.dumps(call["input"], separators=(",", ":"))
            assert message["usage"]["output_tokens"] == 1 + len(split_pieces(arguments))
        named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        _, cut, _ = await create(s, {**body(max_tokens=2, tools=TOOLS), "tool_choice": named})
    assert cut["stop_reason"] == "max_tokens" and cut["content"][0]["type"] == "tool_use"


async def test_streamed_events_byte_checked_and_rebuilt_by_the_sdk(serve: ServeFactory) -> None:
    """A stream is ``message_start``, each block opened by ``content_block_start`` and
    closed by ``content_block_stop``, one delta per engine token (the token opening a
    tool call is its ``content_block_start``), ``message_delta`` and ``message_stop``;
    the SDK's accumulator rebuilds the non-streaming message but for ids, on a reasoning
    model's prose and on a tool call."""
    async with serve(qwen_settings()) as s:
        for request in (
            {**body(max_tokens=12), "model": QWEN},
            {**body(max_tokens=300, tools=TOOLS), "model": QWEN, "tool_choice": {"type": "any"}},
        ):
            _, whole, _ = await create(s, request)
            async with s.stream({**request, "stream": True}, path="/v1/messages") as stream:
                await stream.read_all()
            assert stream.headers["content-type"] == "text/event-stream"
            got = events(stream)
            kinds = [e["type"] for e in got]
            assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
            assert got[0]["message"]["content"] == [] and got[0]["message"]["stop_reason"] is None
            starts = [e for e in got if e["type"] == "content_block_start"]
            stops = [e for e in got if e["type"] == "content_block_stop"]
            assert [e["index"] for e in starts] == [e["index"] for e in stops]
            assert [e["index"] for e in starts] == list(range(len(whole["content"])))
            token_events = [
                e
                for e in got
                if (e["type"] == "content_block_delta" and e["delta"]["type"] != "signature_delta")
                or (e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use")
            ]
            assert len(token_events) == whole["usage"]["output_tokens"]
            rebuilt = rebuild(stream).model_dump(exclude_none=True)
            expected = Message.model_validate(whole).model_dump(exclude_none=True)
            # the second request found the first's prompt cached: compare the totals
            for message in (rebuilt, expected):
                usage = message.pop("usage")
                message["prompt"] = usage["input_tokens"] + usage["cache_read_input_tokens"]
                message["output"] = usage["output_tokens"]
            assert without_ids(rebuilt) == without_ids(expected)
            assert whole["content"][0]["type"] == "thinking"


async def test_thinking_follows_the_request_and_the_model(serve: ServeFactory) -> None:
    """On Qwen3 (which reasons by default) a ``thinking`` block comes first unless
    ``thinking: disabled``; on gpt-oss (default effort none) only when ``thinking`` is
    enabled; usage counts the thinking in ``output_tokens``."""
    async with serve(qwen_settings()) as s:
        _, default, _ = await create(s, {**body(max_tokens=10), "model": QWEN})
        off = {"model": QWEN, "thinking": {"type": "disabled"}}
        _, disabled, _ = await create(s, {**body(max_tokens=10), **off})
        _, plain, _ = await create(s, body(max_tokens=10))
        on = {"type": "enabled", "budget_tokens": 1024}
        _, enabled, _ = await create(s, {**body(max_tokens=2000), "thinking": on})
    assert [b["type"] for b in default["content"]] == ["thinking", "text"]
    assert default["content"][0]["thinking"] == placeholder_text(5)
    assert [b["type"] for b in disabled["content"]] == ["text"]
    assert [b["type"] for b in plain["content"]] == ["text"]
    assert [b["type"] for b in enabled["content"]][0] == "thinking"
    assert default["usage"]["output_tokens"] == 10


async def test_a_stop_sequence_ends_the_message_with_its_name(serve: ServeFactory) -> None:
    async with serve() as s:
        _, message, _ = await create(s, body(max_tokens=100, stop_sequences=["zzz", "many", "she"]))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "she")
    assert message["content"][0]["text"] == placeholder_text(45)[: -len("she ")]


async def test_a_resent_conversation_reads_its_prefix_from_the_cache(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The second turn of a conversation finds the first turn's prompt and answer cached:
    ``cache_read_input_tokens`` counts them, ``input_tokens`` the rest."""
    system = "You are a careful assistant. " * 40
    first = {**body("hello", max_tokens=40), "system": system}
    async with serve() as s:
        _, one, _ = await create(s, first)
        answer = one["content"][0]["text"]
        turns = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then?"},
        ]
        second = {**first, "messages": turns}
        _, two, _ = await create(s, second)
        _, counted, _ = await create(s, second, path="/v1/messages/count_tokens")
    usage = two["usage"]
    assert one["usage"]["cache_read_input_tokens"] == 0
    assert usage["cache_read_input_tokens"] >= 64 * 4
    assert usage["cache_read_input_tokens"] % 64 == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted["input_tokens"]


def token_times(stream: Stream) -> list[float]:
    out = []
    for t, data in stream.chunks:
        for block in data.split(b"\n\n"):
            if b"_delta" in block and b"content_block_delta" in block:
                out.append(t)
    return out


async def test_message_events_are_paced_like_any_stream_of_their_length(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        t0 = trio.current_time()
        async with s.stream(body(max_tokens=12, stream=True), path="/v1/messages") as stream:
            await stream.read_all()
        times = [t - t0 for t in token_times(stream)]
        prompt = events(stream)[0]["message"]["usage"]["input_tokens"]
    async with serve() as s:
        plain = {"model": GPT, "prompt": list(range(prompt)), "max_tokens": 12, "stream": True}
        t0 = trio.current_time()
        async with s.stream(plain, path="/v1/completions") as plain_stream:
            await plain_stream.read_all()
        expected = [t - t0 for t in plain_stream.token_times()]
    assert len(times) == 12
    assert times == pytest.approx(expected, rel=1e-12, abs=1e-12)


async def test_a_full_queue_is_a_529_overloaded_error_and_a_dead_engine_a_503(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Refusals come before any response starts, in Anthropic's envelope: 529
    ``overloaded_error`` with ``Retry-After`` and ``x-should-retry: false``, streamed or
    not; a stopped engine 503 ``api_error``."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with s.stream(chat_body(max_tokens=100, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            async with s.stream(chat_body(max_tokens=3, stream=True)) as waiting:
                await trio.testing.wait_all_tasks_blocked()
                for stream in (True, False):
                    async with s.stream(body(stream=stream), path="/v1/messages") as refused:
                        await refused.read_all()
                    assert refused.status == 529
                    assert refused.headers["x-should-retry"] == "false"
                    assert int(refused.headers["retry-after"]) >= 1
                    error = json.loads(refused.body_bytes())
                    assert error["type"] == "error"
                    assert error["error"]["type"] == "overloaded_error"
                    assert set(error) == {"type", "error"} and set(error["error"]) == {
                        "type",
                        "message",
                    }
                assert rt.snapshot().refused == 2
                await waiting.read_all()
            await running.read_all()
        rt.kill()
        status, error, headers = await create(s, body())
        assert status == 503 and error["error"]["type"] == "api_error"
        assert headers["retry-after"] == "10"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"max_tokens": None}, "max_tokens is required"),
        ({"max_tokens": 0}, "max_tokens must be an integer"),
        ({"messages": []}, "messages must be a non-empty array"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": 7}],
                    }
                ]
            },
            "messages[0].content[0].content must be",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
            "tool_use blocks belong to assistant turns",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "container_upload"}]}]},
            "messages[0].content[0].type",
        ),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "only custom tools"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice names"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"stop_sequences": ["x"] * 65}, "stop_sequences"),
        ({"stream": "yes"}, "stream must be a boolean"),
        ({"system": 12}, "system must be"),
    ],
)
async def test_bad_fields_are_400s_in_anthropics_envelope_naming_the_field(
    serve: ServeFactory, change: dict[str, Any], fragment: str
) -> None:
    request = {k: v for k, v in {**body(max_tokens=3), **change}.items() if v is not None}
    async with serve() as s:
        status, error, _ = await create(s, request)
    assert status == 400
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"], error


async def test_the_gate_answers_the_messages_paths_in_anthropics_envelope(
    serve: ServeFactory,
) -> None:
    """With an API key the Messages routes take it as ``x-api-key`` (Anthropic's clients)
    or a Bearer token; without one, a 401 ``authentication_error``; a GET is a 405, an
    unknown model a 404 ``not_found_error``, a body that is not JSON a 400."""
    settings = attrs.evolve(make_settings(), api_key="sk-test")
    async with serve(settings) as s:
        status, error, _ = await create(s, body())
        assert status == 401 and error["error"]["type"] == "authentication_error"
        status, _, _ = await create(s, body(), headers={"x-api-key": "sk-test"})
        assert status == 200
        status, _, _ = await create(s, body(), headers={"authorization": "Bearer sk-test"})
        assert status == 200
        status, error, _ = await create(s, body(), headers={"x-api-key": "wrong"})
        assert status == 401 and error["error"]["type"] == "authentication_error"
        key = {"x-api-key": "sk-test"}
        status, error, _ = await create(s, {**body(), "model": "nope"}, headers=key)
        assert status == 404 and error["error"]["type"] == "not_found_error"
        response = await s.client.get("/v1/messages", headers=key)
        error = json.loads(await response.get_data())
        assert response.status_code == 405 and error["error"]["type"] == "invalid_request_error"
        response = await s.client.post(
            "/v1/messages", data=b"{", headers={**key, "content-type": "application/json"}
        )
        error = json.loads(await response.get_data())
        assert response.status_code == 400 and error["type"] == "error"
        # the key is not taken as x-api-key on the OpenAI routes
        status, _, _ = await create(s, chat_body(), "/v1/chat/completions", key)
        assert status == 401


async def test_an_engine_failure_mid_stream_ends_with_an_error_event_and_a_client_leaving_frees(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        async with s.stream(body(stream=True, max_tokens=50), path="/v1/messages") as st:
            await st.next_chunk()
            await st.next_chunk()
            async with s.stream(body(stream=True, max_tokens=50), path="/v1/messages") as left:
                await left.next_chunk()
                await left.next_chunk()
            await trio.testing.wait_all_tasks_blocked()
            assert s.runtime().snapshot().aborted == 1
            s.runtime().kill()
            await st.read_all()
    got = events(st)
    assert got[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": got[-1]["error"]["message"]},
    }
    assert "failed" in got[-1]["error"]["message"]


async def test_many_tiny_messages_are_bounded_work(serve: ServeFactory) -> None:
    """A body of 25,000 one-word messages is parsed, counted and
    answered, not refused with a 500 or held."""
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(25_000)
    ]
    data = json.dumps({**body(max_tokens=2), "messages": messages}, separators=(",", ":"))
    assert len(data) < 2 * 1024 * 1024
    async with serve() as s:
        with trio.fail_after(60):
            response = await s.post_raw("/v1/messages", data.encode())
            status, message = response.status_code, json.loads(await response.get_data())
    assert status == 200, message
    assert message["usage"]["input_tokens"] > 25_000
