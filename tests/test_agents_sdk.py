"""The agent API as the official ``openai`` SDK uses it, on a real socket (each test under
``trio.fail_after``, never the autojump clock): chat with tools and ``.parse()`` with a
Pydantic model, the chat stream helper, ``responses.create`` / ``.stream`` / ``.parse``,
embeddings; and every example of ``docs/agents.md``, run and compared with the output
the page shows."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
import trio

from tests.conftest import GPT, ROOT, make_settings
from tests.serve_util import running_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

AGENTS_PAGE = ROOT / "docs" / "agents.md"
#: A ```python block followed by the ```text block of what it prints.
EXAMPLE = re.compile(r"```python\n(.*?)```\n\n```text\n(.*?)```", re.S)
SEPARATOR = "----8<----"


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1)
    temperature: float = pydantic.Field(ge=-50, le=60)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_chat_tool_calls_and_parse_with_a_pydantic_model() -> None:
    """``chat.completions.parse`` with a Pydantic ``response_format`` and with a Pydantic
    function tool: the SDK parses both (no LengthFinishReasonError, valid fields)."""
    with trio.fail_after(30):
        async with running_server(make_settings()) as (url, _, _state):
            client = client_for(url)
            messages: Any = [{"role": "user", "content": "weather?"}]
            parsed = await client.chat.completions.parse(
                model=GPT, messages=messages, response_format=Weather
            )
            assert isinstance(parsed.choices[0].message.parsed, Weather)
            tools = [openai.pydantic_function_tool(Weather, name="get_weather")]
            called = await client.chat.completions.parse(
                model=GPT, messages=messages, tools=tools, tool_choice="required"
            )
            call = called.choices[0].message.tool_calls[0]
            assert called.choices[0].finish_reason == "tool_calls"
            assert isinstance(call.function.parsed_arguments, Weather)
            async with client.chat.completions.stream(
                model=GPT, messages=messages, tools=tools, tool_choice="required"
            ) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_completion()
            assert "tool_calls.function.arguments.done" in kinds
            streamed = final.choices[0].message.tool_calls[0]
            assert streamed.function.arguments == call.function.arguments
            assert isinstance(streamed.function.parsed_arguments, Weather)
            cut = await client.chat.completions.create(
                model=GPT, messages=messages, tools=tools, tool_choice="required", max_tokens=3
            )
            assert cut.choices[0].finish_reason == "length"
            with pytest.raises(openai.LengthFinishReasonError):
                await client.chat.completions.parse(
                    model=GPT, messages=messages, response_format=Weather, max_tokens=3
                )
            await client.close()


async def test_responses_create_streamed_and_not() -> None:
    """``responses.create`` (non-streaming), ``responses.stream`` with a Pydantic
    ``text_format`` and function tools, ``responses.parse``, ``responses.retrieve``."""
    with trio.fail_after(30):
        async with running_server(make_settings()) as (url, _, _state):
            client = client_for(url)
            response = await client.responses.create(
                model=GPT, input="hello", reasoning={"effort": "medium"}
            )
            assert response.status == "completed"
            assert [item.type for item in response.output] == ["reasoning", "message"]
            assert response.output_text and response.usage is not None
            assert response.usage.output_tokens_details.reasoning_tokens == 128
            async with client.responses.stream(
                model=GPT, input="hello", text_format=Weather
            ) as stream:
                deltas = [e async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert isinstance(final.output_parsed, Weather)
            assert "".join(d.delta for d in deltas) == final.output_text
            raw = await client.responses.create(
                model=GPT, input="hello", stream=True, max_output_tokens=5
            )
            kinds = [event.type async for event in raw]
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds.count("response.output_text.delta") == 5
            assert kinds[-1] == "response.incomplete"  # the client's max_output_tokens cut it
            parsed = await client.responses.parse(model=GPT, input="hello", text_format=Weather)
            assert isinstance(parsed.output_parsed, Weather)
            function = {
                "type": "function",
                "name": "get_weather",
                "parameters": Weather.model_json_schema(),
                "strict": False,
            }
            async with client.responses.stream(
                model=GPT,
                input="weather?",
                tools=[function],
                tool_choice="required",  # type: ignore[list-item]
            ) as stream:
                kinds = [e.type async for e in stream]
                final = await stream.get_final_response()
            assert "response.function_call_arguments.delta" in kinds
            call = final.output[0]
            assert call.type == "function_call"
            jsonschema.validate(json.loads(call.arguments), Weather.model_json_schema())
            again = await client.responses.retrieve(final.id)
            assert again.output[0].type == "function_call"
            await client.close()


async def test_embeddings_through_the_sdk() -> None:
    """The SDK's default (base64, decoded by the SDK) and ``float`` give the same unit
    vectors."""
    with trio.fail_after(30):
        async with running_server(make_settings()) as (url, _, state):
            client = client_for(url)
            packed = await client.embeddings.create(model=GPT, input=["a b c", "d e f"])
            floats = await client.embeddings.create(
                model=GPT, input=["a b c", "d e f"], encoding_format="float"
            )
            assert [len(d.embedding) for d in packed.data] == [2880, 2880]
            for a, b in zip(packed.data, floats.data, strict=True):
                assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
                assert sum(x * x for x in a.embedding) == pytest.approx(1.0, abs=1e-5)
            assert packed.usage.prompt_tokens == 4
            await client.close()
            assert state.runtimes[GPT].snapshot().admitted == 4


def examples() -> list[tuple[str, str]]:
    """(code, printed output) of each example of docs/agents.md."""
    return [(m.group(1), m.group(2)) for m in EXAMPLE.finditer(AGENTS_PAGE.read_text())]


def test_the_agents_page_has_its_examples() -> None:
    found = examples()
    assert len(found) >= 7
    assert all("OUTPUT" not in printed for _, printed in found)


async def test_the_agents_page_examples_print_what_the_page_shows() -> None:
    """Every example of docs/agents.md, run with the official SDK in a fresh Python
    against a real server (the page's address replaced by the server's), prints exactly
    the output shown under it: content is a function of the request and the seed. The
    server draws prose lengths as ``inference-lab serve`` does by default."""
    found = examples()
    with trio.fail_after(120):
        async with running_server(make_settings(run_to_max_tokens=False)) as (url, _, _state):
            script = "".join(
                f"exec(compile({code.replace('http://127.0.0.1:8080', url)!r}, "
                f"'docs/agents.md example {i}', 'exec'), {{}})\nprint({SEPARATOR!r})\n"
                for i, (code, _) in enumerate(found)
            )
            result = await trio.run_process(
                [sys.executable, "-c", script],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    printed = result.stdout.decode().split(SEPARATOR + "\n")[:-1]
    assert printed == [shown for _, shown in found]
