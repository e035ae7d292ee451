"""pydantic-ai as a client of ``serve`` on a real socket, each test under
``trio.fail_after``, through its OpenAI models pointed at the server: ``OpenAIChatModel``
(``POST /v1/chat/completions``) and ``OpenAIResponsesModel`` (``POST /v1/responses``). An
agent with one function tool runs to a final answer (``agent.run``) and streamed
(``agent.run_stream``); a structured ``output_type`` validates, as pydantic-ai's default
output tool and as ``NativeOutput`` (a JSON schema ``response_format``); a full queue's
529 reaches the caller as pydantic-ai raises it, and the server's refusal count shows it
was not retried.

pydantic-ai is not a test extra (``pydantic-ai-slim[openai]`` is part of the ``clients``
extra: ``make test-clients``), so the module skips where it is absent. pydantic-ai runs on
asyncio, so each run goes to its own ``asyncio.run`` in a worker thread
(``trio.to_thread``) while the server runs on this thread's trio loop. A server answer
pydantic-ai could not use (arguments that do not validate, output of the wrong shape) would
show as a ``RetryPromptPart`` in the run's messages; every test asserts there is none.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import attrs
import pydantic
import pytest
import trio

from tests.conftest import GPT, chat_body, make_settings
from tests.serve_util import http_request, running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

pytest.importorskip(
    "pydantic_ai",
    reason="pydantic-ai is not installed: `make test-clients` runs this file with the "
    "clients extra",
)
import openai  # noqa: E402
from pydantic_ai import Agent, ModelSettings, NativeOutput, UsageLimits  # noqa: E402
from pydantic_ai.exceptions import ModelHTTPError, ModelOverloadedError  # noqa: E402
from pydantic_ai.messages import (  # noqa: E402
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

T = TypeVar("T")
INSTRUCTIONS = "You answer questions about the weather. Use the tools you have."
#: Several questions: whether an ``auto`` answer calls the tool is drawn from the request
#: (docs/agents.md), so one question alone would test one fixed decision.
QUESTIONS = ("What is the weather in Paris?", "What is the weather in Oslo on Friday?")
MODELS = ("chat", "responses")
LIMITS = UsageLimits(request_limit=10)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1)
    temperature: float = pydantic.Field(ge=-50, le=60)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


@attrs.define
class Tools:
    """The cities the ``get_weather`` tool was called with, and the clients made."""

    cities: list[str] = attrs.field(factory=list)
    clients: list[openai.AsyncOpenAI] = attrs.field(factory=list)

    async def aclose(self) -> None:
        """Close the clients (before their asyncio loop ends)."""
        for client in self.clients:
            await client.close()

    def agent(self, url: str, kind: str, **kwargs: Any) -> Agent[None, Any]:
        """An agent on pydantic-ai's ``kind`` OpenAI model ("chat" or "responses") of the
        server at ``url``, with the ``get_weather`` tool; the ``openai`` client's retries
        are off."""
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.clients.append(client)
        provider = OpenAIProvider(openai_client=client)
        model: Any = (
            OpenAIChatModel(GPT, provider=provider)
            if kind == "chat"
            else OpenAIResponsesModel(GPT, provider=provider)
        )
        agent: Agent[None, Any] = Agent(model, instructions=INSTRUCTIONS, **kwargs)

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the current weather for a city."""
            self.cities.append(city)
            return f"Sunny and 21 degrees in {city}."

        return agent


async def on_asyncio(run: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``run()`` on its own asyncio loop in a worker thread: pydantic-ai runs on asyncio,
    and the server answers on this thread's trio loop."""
    return await trio.to_thread.run_sync(lambda: asyncio.run(run()))


def settings(**kwargs: Any) -> Any:
    """gpt-oss-20b with prose lengths drawn as ``inference-lab serve`` draws them."""
    return attrs.evolve(make_settings(run_to_max_tokens=False), **kwargs)


def parts(messages: list[Any], kind: type) -> list[Any]:
    return [part for message in messages for part in message.parts if isinstance(part, kind)]


def function_calls(messages: list[Any]) -> list[ToolCallPart]:
    return [p for p in parts(messages, ToolCallPart) if p.tool_name == "get_weather"]


@pytest.mark.parametrize("kind", MODELS)
async def test_an_agent_with_a_tool_runs_to_a_final_answer(kind: str) -> None:
    """Each run ends with a non-empty ``str`` output (the last response's text); the tool
    ran once per call pydantic-ai recorded, each call's return went back, nothing was
    sent back for a retry, the tool ran at least once over the runs, and the server
    admitted exactly pydantic-ai's model requests."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, state):
            runs = []
            for ask in QUESTIONS:
                tools = Tools()

                async def run(t: Tools = tools, q: str = ask) -> Any:
                    result = await t.agent(url, kind).run(q, usage_limits=LIMITS)
                    await t.aclose()
                    return result

                runs.append((tools, await on_asyncio(run)))
            admitted = state.runtimes[GPT].snapshot().admitted
    requests = 0
    for tools, result in runs:
        messages = result.all_messages()
        assert isinstance(result.output, str) and result.output.strip()
        last = messages[-1]
        assert isinstance(last, ModelResponse)
        assert "".join(p.content for p in last.parts if isinstance(p, TextPart)) == result.output
        calls = function_calls(messages)
        assert len(tools.cities) == len(calls) == result.usage.tool_calls
        assert all(city.strip() for city in tools.cities)
        returned = parts(messages, ToolReturnPart)
        assert [p.tool_call_id for p in returned] == [c.tool_call_id for c in calls]
        assert not parts(messages, RetryPromptPart)
        responses = [m for m in messages if isinstance(m, ModelResponse)]
        assert result.usage.requests == len(responses) <= 10
        requests += len(responses)
    assert sum(len(t.cities) for t, _ in runs) >= 1
    assert admitted == requests


@pytest.mark.parametrize("kind", MODELS)
async def test_a_streamed_run_ends_with_the_streamed_answer(kind: str) -> None:
    """``agent.run_stream`` (pydantic-ai runs the tool calls it streams and streams on to
    the answer): each stream ends complete, its text deltas make up the output, the tool
    ran once per call and at least once over the runs, nothing was sent back for a retry,
    and every model request was streamed."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, _state):
            tools = Tools()

            async def run() -> list[tuple[list[str], str, list[Any]]]:
                streamed = []
                for ask in QUESTIONS:
                    async with tools.agent(url, kind).run_stream(
                        ask, usage_limits=LIMITS
                    ) as result:
                        deltas = [d async for d in result.stream_text(delta=True)]
                        output = await result.get_output()
                        assert result.is_complete
                    streamed.append((deltas, output, result.all_messages()))
                await tools.aclose()
                return streamed

            streamed = await on_asyncio(run)
    for deltas, output, messages in streamed:
        assert isinstance(output, str) and output.strip()
        assert "".join(deltas) == output
        assert not parts(messages, RetryPromptPart)
    calls = sum(len(function_calls(messages)) for _, _, messages in streamed)
    assert len(tools.cities) == calls >= 1


@pytest.mark.parametrize("kind", MODELS)
async def test_a_structured_output_type_validates(kind: str) -> None:
    """``output_type`` a Pydantic model with bounds and a pattern: as pydantic-ai's
    default output tool (``final_result``, which it requires the model to call) and as
    ``NativeOutput`` (a JSON schema response format), the run ends with a valid instance
    and no retry was asked for; the default mode's output came from a call of its output
    tool."""
    with trio.fail_after(90):
        async with running_server(settings()) as (url, _, _state):

            async def run() -> list[Any]:
                results = []
                tools = Tools()
                for output_type in (Weather, NativeOutput(Weather)):
                    agent = tools.agent(url, kind, output_type=output_type)
                    results.append(await agent.run(QUESTIONS[0], usage_limits=LIMITS))
                await tools.aclose()
                return results

            tool_mode, native = await on_asyncio(run)
    for result in (tool_mode, native):
        assert isinstance(result.output, Weather)
        Weather.model_validate(result.output.model_dump())
        assert not parts(result.all_messages(), RetryPromptPart)
    outputs = [
        p for p in parts(tool_mode.all_messages(), ToolCallPart) if p.tool_name == "final_result"
    ]
    assert len(outputs) == 1
    assert Weather.model_validate(outputs[0].args_as_dict()) == tool_mode.output


async def test_a_529_as_pydantic_ai_raises_it_without_retries() -> None:
    """With the queue full, a run and a streamed run on each model raise pydantic-ai's
    ``ModelOverloadedError`` (also a ``ModelHTTPError``) with ``status_code`` 529 and the
    envelope's type and code; with retries off the server counts exactly one refusal per
    run (the server here leaves ``x-should-retry: false`` off, so not retrying is the
    client's own doing)."""
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
            for kind in MODELS:
                for streamed in (False, True):
                    tools = Tools()
                    agent = tools.agent(url, kind, model_settings=ModelSettings(max_retries=0))

                    async def run(
                        a: Agent[None, Any] = agent, s: bool = streamed, t: Tools = tools
                    ) -> None:
                        try:
                            if s:
                                async with a.run_stream("hi") as result:
                                    await result.get_output()
                            else:
                                await a.run("hi")
                        finally:
                            await t.aclose()

                    with pytest.raises(ModelOverloadedError) as caught:
                        await on_asyncio(run)
                    raised.append(caught.value)
                    refused.append(runtime.snapshot().refused)
            for stream in streams:
                await stream.aclose()
    for error in raised:
        assert isinstance(error, ModelHTTPError)
        assert error.status_code == 529
        assert error.provider_error_type == "overloaded_error"
        assert error.provider_error_code == "queue_saturated"
    assert refused == [1, 2, 3, 4]
