"""openai-agents (the OpenAI Agents SDK) as a client of ``serve`` on a real socket, each
test under ``trio.fail_after``, through both of its OpenAI models: ``OpenAIResponsesModel``
(``POST /v1/responses``) and ``OpenAIChatCompletionsModel`` (``POST
/v1/chat/completions``). An agent with one function tool runs to a final answer
(``Runner.run``) and streamed (``Runner.run_streamed``); a structured ``output_type``
validates; a full queue's 529 reaches the caller as the SDK raises it, and the server's
refusal count shows the SDK did not retry it.

openai-agents is not a test extra (it is part of the ``clients`` extra: ``make
test-clients``), so the module skips where it is absent. The SDK runs on asyncio, so each
run goes to its own ``asyncio.run`` in a worker thread (``trio.to_thread``) while the
server runs on this thread's trio loop. What the SDK sent is recorded by an event hook of
the ``httpx2`` client (the ``openai`` SDK's HTTP library) given to its ``AsyncOpenAI``
client, and the server's own counts (admitted, refused) are compared with the SDK's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import attrs
import httpx2
import pydantic
import pytest
import trio

from tests.conftest import GPT, chat_body, make_settings
from tests.serve_util import http_request, running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

pytest.importorskip(
    "agents",
    reason="openai-agents is not installed: `make test-clients` runs this file with the "
    "clients extra",
)
import openai  # noqa: E402
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # no trace exporter: nothing leaves 127.0.0.1

T = TypeVar("T")
INSTRUCTIONS = "You answer questions about the weather. Use the tools you have."
#: Several questions: whether an ``auto`` answer calls the tool is drawn from the request
#: (docs/agents.md), so one question alone would test one fixed decision.
QUESTIONS = ("What is the weather in Paris?", "What is the weather in Oslo on Friday?")
MODELS = ("responses", "chat")
ROUTE = {"responses": "/v1/responses", "chat": "/v1/chat/completions"}


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1)
    temperature: float = pydantic.Field(ge=-50, le=60)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


@attrs.define
class Recorder:
    """What one run did: the (path, JSON body) of each request the SDK sent, and the
    arguments of each call of the tool."""

    sent: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)
    tool_calls: list[str] = attrs.field(factory=list)
    clients: list[openai.AsyncOpenAI] = attrs.field(factory=list)

    async def aclose(self) -> None:
        """Close the clients (before their asyncio loop ends)."""
        for client in self.clients:
            await client.close()

    async def on_request(self, request: httpx2.Request) -> None:
        self.sent.append((request.url.path, json.loads(request.content or b"{}")))

    def agent(self, url: str, kind: str, **kwargs: Any) -> Agent[Any]:
        """An agent on model ``kind`` ("responses" or "chat") of the server at ``url``,
        with the ``get_weather`` tool that records its calls; the ``openai`` client's
        retries are off."""
        http = httpx2.AsyncClient(event_hooks={"request": [self.on_request]})
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
        )
        self.clients.append(client)
        model: Any = (
            OpenAIResponsesModel(model=GPT, openai_client=client)
            if kind == "responses"
            else OpenAIChatCompletionsModel(model=GPT, openai_client=client)
        )

        @function_tool
        def get_weather(city: str) -> str:
            """Get the current weather for a city."""
            self.tool_calls.append(city)
            return f"Sunny and 21 degrees in {city}."

        return Agent(
            name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model, **kwargs
        )


async def on_asyncio(run: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``run()`` on its own asyncio loop in a worker thread: the SDK runs on asyncio, and
    the server answers on this thread's trio loop."""
    return await trio.to_thread.run_sync(lambda: asyncio.run(run()))


def settings(**kwargs: Any) -> Any:
    """gpt-oss-20b with prose lengths drawn as ``inference-lab serve`` draws them (so an
    answer ends ``stop`` and a Responses answer ``completed``, as a model's would)."""
    return attrs.evolve(make_settings(run_to_max_tokens=False), **kwargs)


def tool_items(result: Any) -> int:
    return sum(1 for item in result.new_items if item.type == "tool_call_item")


@pytest.mark.parametrize("kind", MODELS)
async def test_an_agent_with_a_tool_runs_to_a_final_answer(kind: str) -> None:
    """Each run ends with a non-empty ``str`` answer after a few model calls; the tool ran
    as often as the SDK recorded calls of it, with the city its schema asks for, and at
    least once over the runs; the server admitted exactly the SDK's model calls, all on
    the model's route, tool results sent back as the API's own items."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, state):
            runs = []
            for ask in QUESTIONS:
                recorder = Recorder()

                async def run(r: Recorder = recorder, q: str = ask) -> Any:
                    result = await Runner.run(r.agent(url, kind), q, max_turns=10)
                    await r.aclose()
                    return result

                runs.append((recorder, await on_asyncio(run)))
            admitted = state.runtimes[GPT].snapshot().admitted
    calls = 0
    for recorder, result in runs:
        assert isinstance(result.final_output, str) and result.final_output.strip()
        assert len(recorder.tool_calls) == tool_items(result)
        assert all(city.strip() for city in recorder.tool_calls)
        assert len(result.raw_responses) == len(recorder.sent) <= 10
        assert result.context_wrapper.usage.requests == len(recorder.sent)
        assert {path for path, _ in recorder.sent} == {ROUTE[kind]}
        last = result.raw_responses[-1].output
        assert [item.type for item in last if item.type != "reasoning"] == ["message"]
        assert last[-1].content[0].text == result.final_output
        calls += len(recorder.sent)
        if recorder.tool_calls:  # the tool's output went back in the next request
            body = recorder.sent[-1][1]
            sent = body["input"] if kind == "responses" else body["messages"]
            kinds = {m.get("type") for m in sent} | {m.get("role") for m in sent}
            assert ("function_call_output" if kind == "responses" else "tool") in kinds
    assert sum(len(r.tool_calls) for r, _ in runs) >= 1
    assert admitted == calls


@pytest.mark.parametrize("kind", MODELS)
async def test_a_streamed_run_ends_with_the_streamed_answer(kind: str) -> None:
    """``Runner.run_streamed`` with the tool required on the first call (the SDK resets
    it after the tool ran, so the run can end): the stream ends, the run is complete, its
    text deltas make up the final answer, and its ``tool_called`` / ``tool_output`` events
    match the tool's runs (at least one)."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, _state):
            recorder = Recorder()

            async def run() -> tuple[Any, list[Any]]:
                agent = recorder.agent(
                    url, kind, model_settings=ModelSettings(tool_choice="required")
                )
                result = Runner.run_streamed(agent, QUESTIONS[0], max_turns=10)
                events = [event async for event in result.stream_events()]
                await recorder.aclose()
                return result, events

            result, events = await on_asyncio(run)
    assert result.is_complete
    assert isinstance(result.final_output, str) and result.final_output.strip()
    raw = [e.data for e in events if e.type == "raw_response_event"]
    deltas = [e.delta for e in raw if e.type == "response.output_text.delta"]
    assert "".join(deltas) == result.final_output
    named = [e.name for e in events if e.type == "run_item_stream_event"]
    assert len(recorder.tool_calls) >= 1
    assert named.count("tool_called") == named.count("tool_output") == len(recorder.tool_calls)
    assert named[-1] == "message_output_created"
    assert sum(1 for e in raw if e.type == "response.completed") == len(recorder.sent)
    assert all(body["stream"] is True for _, body in recorder.sent)
    assert recorder.sent[0][1]["tool_choice"] == "required"
    assert recorder.sent[-1][1].get("tool_choice") in (None, "auto")


@pytest.mark.parametrize("kind", MODELS)
async def test_a_structured_output_type_validates(kind: str) -> None:
    """An agent whose ``output_type`` is a Pydantic model (with bounds and a pattern) ends
    with an instance of it, non-streamed and streamed; the SDK asked for it as a strict
    JSON schema (``text.format`` on the Responses API, ``response_format`` on chat)."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, _state):
            recorder = Recorder()

            async def run() -> tuple[Any, Any]:
                plain = await Runner.run(
                    recorder.agent(url, kind, output_type=Weather), QUESTIONS[0], max_turns=10
                )
                streamed = Runner.run_streamed(
                    recorder.agent(url, kind, output_type=Weather), QUESTIONS[1], max_turns=10
                )
                async for _event in streamed.stream_events():
                    pass
                await recorder.aclose()
                return plain, streamed

            plain, streamed = await on_asyncio(run)
    for result in (plain, streamed):
        assert isinstance(result.final_output, Weather)
        Weather.model_validate(result.final_output.model_dump())
    asked = recorder.sent[0][1]
    schema = asked["text"]["format"] if kind == "responses" else asked["response_format"]
    if kind == "chat":
        assert schema["type"] == "json_schema"
        schema = schema["json_schema"]
    assert schema["strict"] is True
    assert set(schema["schema"]["required"]) == {"city", "temperature", "unit"}


async def test_a_529_as_the_sdk_raises_it_without_retries() -> None:
    """With the queue full, each model's run (and a streamed run) raises the ``openai``
    SDK's ``InternalServerError`` with ``status_code`` 529 and the server's envelope; with
    the SDK's retries off (``max_retries`` 0 and no runner retry policy) the server counts
    exactly one refusal per run. The server here leaves ``x-should-retry: false`` off, so
    not retrying is the client's own doing (a client allowed retries would wait out the
    ``Retry-After`` and be served once the held streams end)."""
    with trio.fail_after(60):
        held = attrs.evolve(make_settings(max_num_seqs=1, max_waiting=1), should_retry_header=False)
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
            raised: list[BaseException] = []
            refused = []
            for kind, streamed in (
                ("responses", False),
                ("chat", False),
                ("responses", True),
                ("chat", True),
            ):
                recorder = Recorder()
                agent = recorder.agent(url, kind)

                async def run(
                    a: Agent[Any] = agent, s: bool = streamed, r: Recorder = recorder
                ) -> None:
                    try:
                        if s:
                            async for _event in Runner.run_streamed(a, "hi").stream_events():
                                pass
                        else:
                            await Runner.run(a, "hi")
                    finally:
                        await r.aclose()

                with pytest.raises(openai.InternalServerError) as caught:
                    await on_asyncio(run)
                raised.append(caught.value)
                refused.append(runtime.snapshot().refused)
            for stream in streams:
                await stream.aclose()
    for error in raised:
        assert isinstance(error, openai.InternalServerError)
        assert error.status_code == 529
        assert error.body == {
            "message": error.body["message"],  # type: ignore[index]
            "type": "overloaded_error",
            "code": "queue_saturated",
        }
    assert refused == [1, 2, 3, 4]
