"""``/v1/responses`` in memory (``docs/agents.md``): the response object, its streamed
events byte-checked and rebuilt by the openai SDK's own stream state, stored responses
and ``previous_response_id``, and the admission contract. Time-dependent tests run on
the autojump MockClock."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
import trio
import trio.testing
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from inference_lab.api.agents import split_pieces
from inference_lab.api.text import placeholder_text
from inference_lab.api.tokenizer import ChatMessage
from inference_lab.serve.response_store import ResponseStore, StoredResponse
from tests.conftest import GPT, ServeFactory, Stream, chat_body, make_settings

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]


def body(input_: Any = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": GPT, "input": input_, **extra}


async def create(s: Any, request: dict[str, Any]) -> tuple[int, Any]:
    response = await s.post("/v1/responses", request)
    return response.status_code, json.loads(await response.get_data())


def events(stream: Stream) -> list[dict[str, Any]]:
    """The stream's events, each checked to be ``event: <type>`` then ``data: <json>``
    whose ``type`` is the same."""
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


def rebuild(stream: Stream) -> Any:
    """The openai SDK's stream state fed every event: its completed response, or (for an
    incomplete one, which the SDK does not complete) its snapshot of the output."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events(stream):
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    if state._completed_response is not None:
        return state._completed_response
    return state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]


def without_ids(value: Any) -> Any:
    """``value`` without the fields that differ between two answers to one request."""
    if isinstance(value, dict):
        return {
            k: without_ids(v)
            for k, v in value.items()
            if k not in ("id", "call_id", "created_at", "item_id")
        }
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


async def test_a_prose_response_completes_with_usage(serve: ServeFactory) -> None:
    """A string input gets one assistant message of placeholder words; without
    ``max_output_tokens`` it runs to the default length and completes."""
    async with serve(make_settings(default_max_tokens=6)) as s:
        status, response = await create(s, body(instructions="be brief"))
    assert status == 200
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["instructions"] == "be brief"
    [message] = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == "the of and to in a"
    usage = response["usage"]
    assert usage["output_tokens"] == 6
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + 6


async def test_max_output_tokens_makes_a_prose_response_incomplete(serve: ServeFactory) -> None:
    async with serve() as s:
        _, response = await create(s, body(max_output_tokens=3))
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["max_output_tokens"] == 3
    assert response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 3


async def test_input_items_instructions_and_tools_are_counted_as_chat(serve: ServeFactory) -> None:
    """Input items are counted as the chat messages they stand for: the same prompt
    tokens as the equivalent chat request."""
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    async with serve() as s:
        _, response = await create(
            s,
            body(
                items, instructions="be brief", tools=TOOLS, max_output_tokens=2, tool_choice="none"
            ),
        )
        chat = await s.post(
            "/v1/chat/completions",
            {"model": GPT, "messages": messages, "tools": chat_tools, "max_tokens": 2},
        )
        usage = json.loads(await chat.get_data())["usage"]
    assert response["usage"]["input_tokens"] == usage["prompt_tokens"]


async def test_function_tools_answer_with_function_call_items(serve: ServeFactory) -> None:
    async with serve() as s:
        _, response = await create(s, body(tools=TOOLS, tool_choice="required"))
    [call] = response["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert response["usage"]["output_tokens"] == 1 + len(split_pieces(call["arguments"]))
    assert response["status"] == "completed"


async def test_text_format_json_schema_is_followed(serve: ServeFactory) -> None:
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    async with serve() as s:
        _, response = await create(s, body(text={"format": fmt}))
    text = response["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), WEATHER)
    assert response["text"] == {"format": fmt}
    assert response["usage"]["output_tokens"] == len(split_pieces(text))


async def test_reasoning_effort_adds_a_reasoning_item(serve: ServeFactory) -> None:
    async with serve() as s:
        _, response = await create(s, body(max_output_tokens=10, reasoning={"effort": "high"}))
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": placeholder_text(8)}]
    assert (
        message["content"][0]["text"]
        == placeholder_text(10).rstrip(" ")[len(placeholder_text(8)) :]
    )
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 8}
    assert response["reasoning"]["effort"] == "high"


@pytest.mark.parametrize(
    "extra",
    [
        {"max_output_tokens": 7, "reasoning": {"effort": "medium"}},
        {"tools": TOOLS, "tool_choice": "required", "reasoning": {"effort": "low"}},
        {"text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}},
        {"tools": TOOLS, "tool_choice": "required", "max_output_tokens": 4},
    ],
)
async def test_streamed_events_byte_checked_and_rebuilt_by_the_sdk(
    serve: ServeFactory, extra: dict[str, Any]
) -> None:
    """A stream is ``response.created``, ``response.in_progress``, then one delta event per
    engine token (the token opening a call is its ``output_item.added``), items opened and
    closed with their ``added`` / ``done`` events, and last ``response.completed`` (or
    ``incomplete``) with the whole response; sequence numbers count from 0 without a gap.
    The SDK's stream state rebuilds the same response, which equals the non-streaming
    one but for ids."""
    request = body(**extra)
    async with serve() as s:
        _, whole = await create(s, request)
        async with s.stream({**request, "stream": True}, path="/v1/responses") as stream:
            await stream.read_all()
    assert stream.headers["content-type"] == "text/event-stream"
    got = events(stream)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got[:2]] == ["response.created", "response.in_progress"]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    last = got[-1]
    assert last["type"] == f"response.{whole['status']}"
    assert without_ids(last["response"]) == without_ids(whole)
    deltas = [e for e in got if e["type"].endswith(".delta")]
    openings = [
        e
        for e in got
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]
    assert len(deltas) + len(openings) == whole["usage"]["output_tokens"]
    for item_index, item in enumerate(last["response"]["output"]):
        added = [
            e
            for e in got
            if e["type"] == "response.output_item.added" and e["output_index"] == item_index
        ]
        done = [
            e
            for e in got
            if e["type"] == "response.output_item.done" and e["output_index"] == item_index
        ]
        assert len(added) == len(done) == 1
        assert done[0]["item"] == item
        assert added[0]["item"]["id"] == item["id"]
        assert got.index(added[0]) < got.index(done[0])
    rebuilt = rebuild(stream)

    def content(item: Any) -> Any:
        """What an item says (its status aside: a snapshot keeps the added item's)."""
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "function_call":
            return (item["call_id"], item["name"], item["arguments"])
        if item["type"] == "message":
            return (item["id"], [part["text"] for part in item["content"]])
        return (item["id"],)

    assert [content(i) for i in rebuilt.output] == [content(i) for i in last["response"]["output"]]
    if whole["status"] == "completed":
        assert rebuilt.usage.output_tokens == whole["usage"]["output_tokens"]


async def test_stored_responses_continue_and_can_be_read_and_deleted(serve: ServeFactory) -> None:
    """A stored response (the default) is returned by ``GET /v1/responses/{id}``; a
    follow-up with ``previous_response_id`` is counted over the whole conversation;
    ``store: false`` keeps nothing; ``DELETE`` forgets; an unknown id is a 400."""
    async with serve() as s:
        _, first = await create(s, body("hello world", max_output_tokens=4))
        response = await s.client.get(f"/v1/responses/{first['id']}")
        assert response.status_code == 200
        assert json.loads(await response.get_data()) == first
        _, second = await create(
            s, body("and then?", previous_response_id=first["id"], max_output_tokens=2)
        )
        assert second["previous_response_id"] == first["id"]
        conversation = [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the of and to"},
            {"role": "user", "content": "and then?"},
        ]
        chat = await s.post(
            "/v1/chat/completions", {"model": GPT, "messages": conversation, "max_tokens": 1}
        )
        assert (
            second["usage"]["input_tokens"]
            == json.loads(await chat.get_data())["usage"]["prompt_tokens"]
        )
        _, unstored = await create(s, body(store=False, max_output_tokens=1))
        assert (await s.client.get(f"/v1/responses/{unstored['id']}")).status_code == 404
        status, error = await create(s, body(previous_response_id=unstored["id"]))
        assert status == 400 and error["error"]["param"] == "previous_response_id"
        deleted = await s.client.delete(f"/v1/responses/{first['id']}")
        assert json.loads(await deleted.get_data()) == {
            "id": first["id"],
            "object": "response.deleted",
            "deleted": True,
        }
        assert (await s.client.get(f"/v1/responses/{first['id']}")).status_code == 404
        assert (await s.client.delete(f"/v1/responses/{first['id']}")).status_code == 404


async def test_a_streamed_response_is_stored_once_completed(serve: ServeFactory) -> None:
    async with serve() as s:
        async with s.stream(body(max_output_tokens=3, stream=True), path="/v1/responses") as st:
            await st.read_all()
        final = events(st)[-1]["response"]
        response = await s.client.get(f"/v1/responses/{final['id']}")
        assert json.loads(await response.get_data()) == final


def test_the_store_is_bounded_and_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    item = StoredResponse(body=b"x" * 100, messages=(ChatMessage("user", "hi"),))
    for i in range(3):
        store.put(f"r{i}", item)
    assert store.get("r0") is not None  # r0 is now the most recently used
    store.put("r3", item)
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 3
    store.put("big", StoredResponse(body=b"y" * 9_900, messages=()))
    assert len(store) == 1 and store.get("big") is not None
    store.put("huge", StoredResponse(body=b"z" * 20_000, messages=()))  # alone past the bound
    assert store.get("huge") is None
    assert store.evicted == 4


def test_the_store_counts_call_arguments_outputs_and_input_items() -> None:
    """A stored conversation's function-call arguments, tool outputs and names count
    against the byte bound as much as its text does (issue 45: 480 KB arguments counted
    as nothing let 1,024 responses hold 552 MB)."""
    arguments = json.dumps({"blob": "a" * 100_000})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    item = StoredResponse(
        body=b"{}",
        messages=(
            ChatMessage("assistant", "", [call]),
            ChatMessage("tool", "b" * 50_000, None, None, "c1"),
        ),
    )
    assert item.size >= 150_000
    store = ResponseStore(max_responses=100, max_bytes=1_000_000)
    for i in range(10):
        store.put(f"r{i}", item)
    assert store.bytes <= 1_000_000 and len(store) == 6 and store.evicted == 4


async def test_a_stored_response_counts_its_input_items(serve: ServeFactory) -> None:
    """Through the route: input items holding a large function call and its output are
    counted when the response is stored."""
    items = [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "x" * 200_000},
        {"type": "function_call_output", "call_id": "c1", "output": "y" * 100_000},
    ]
    async with serve() as s:
        status, response = await create(s, body(items, max_output_tokens=2))
        assert status == 200, response
        assert s.state.responses.bytes >= 300_000


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": 5}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
async def test_bad_fields_are_400s_naming_the_field(
    serve: ServeFactory, extra: dict[str, Any], param: str
) -> None:
    async with serve() as s:
        status, error = await create(s, body(**extra))
        assert status == 400, error
        assert error["error"]["param"] == param
        assert s.runtime().snapshot().admitted == 0


async def test_an_unknown_model_is_a_404_and_other_methods_a_405(serve: ServeFactory) -> None:
    async with serve() as s:
        status, error = await create(s, {**body(), "model": "nope"})
        assert status == 404 and error["error"]["code"] == "model_not_found"
        response = await s.client.get("/v1/responses")
        assert response.status_code == 405


def event_times(stream: Stream) -> list[float]:
    """Arrival times of the events that carry a token."""
    out = []
    for t, data in stream.chunks:
        for block in data.split(b"\n\n"):
            if b"event: response." in block and (
                b".delta" in block or b'"type":"function_call"' in block and b"added" in block
            ):
                out.append(t)
    return out


async def test_response_events_are_paced_like_any_stream_of_their_length(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A streamed response's token events leave at the engine's step ends: the times of a
    chat stream of the same prompt and length."""
    async with serve() as s:
        t0 = trio.current_time()
        request = body(max_output_tokens=12, reasoning={"effort": "medium"}, stream=True)
        async with s.stream(request, path="/v1/responses") as stream:
            await stream.read_all()
        times = [t - t0 for t in event_times(stream)]
        prompt = events(stream)[-1]["response"]["usage"]["input_tokens"]
    async with serve() as s:
        plain = {"model": GPT, "prompt": list(range(prompt)), "max_tokens": 12, "stream": True}
        t0 = trio.current_time()
        async with s.stream(plain, path="/v1/completions") as plain_stream:
            await plain_stream.read_all()
        expected = [t - t0 for t in plain_stream.token_times()]
    assert len(times) == 12
    assert times == pytest.approx(expected, rel=1e-12, abs=1e-12)


async def test_responses_get_529_and_503_before_any_response_starts(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with s.stream(chat_body(max_tokens=100, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            async with s.stream(chat_body(max_tokens=3, stream=True)) as waiting:
                await trio.testing.wait_all_tasks_blocked()
                for stream in (True, False):
                    async with s.stream(body(stream=stream), path="/v1/responses") as refused:
                        await refused.read_all()
                    assert refused.status == 529
                    assert refused.headers["content-type"] == "application/json"
                    assert json.loads(refused.body_bytes())["error"]["code"] == "queue_saturated"
                assert rt.snapshot().refused == 2
                await waiting.read_all()
            await running.read_all()
        rt.kill()
        status, error = await create(s, body())
        assert status == 503 and error["error"]["code"] == "engine_unavailable"


async def test_an_engine_failure_mid_stream_ends_with_an_error_event(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        async with s.stream(body(stream=True, max_output_tokens=50), path="/v1/responses") as st:
            await st.next_chunk()
            await st.next_chunk()
            s.runtime().kill()
            await st.read_all()
    got = events(st)
    assert got[-1]["type"] == "error" and got[-1]["code"] == "engine_failed"
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert not any(e["type"] == "response.completed" for e in got)


async def test_a_client_leaving_a_response_stream_frees_its_slot(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        rt = s.runtime()
        async with s.stream(body(stream=True, max_output_tokens=100), path="/v1/responses") as st:
            await st.next_chunk()
            await st.next_chunk()
        await trio.testing.wait_all_tasks_blocked()
        snap = rt.snapshot()
        assert (snap.running, snap.queued, snap.aborted) == (0, 0, 1)
        assert rt.statistics().engine.kv_usage == 0.0
        assert len(s.state.responses) == 0  # an aborted response is not stored


async def test_reasoning_share_follows_the_effort_on_a_json_answer(serve: ServeFactory) -> None:
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER}
    async with serve() as s:
        _, plain = await create(s, body(text={"format": fmt}))
        _, high = await create(s, body(text={"format": fmt}, reasoning={"effort": "high"}))
    document = plain["usage"]["output_tokens"]
    reasoning = math.ceil(0.8 * document / 0.2)
    assert high["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning
    assert high["output"][1]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
