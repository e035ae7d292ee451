"""Agent answers on ``/v1/chat/completions`` in memory: tool calls, structured output,
reasoning (``docs/agents.md``). Time-dependent tests run on the autojump MockClock.

Every answer's length and timing come from the engine; what is checked here is what the
tokens spell, their frames, and that the contract around them (400 / 529 / 503 before a
response starts, pacing, leaks) is the plain route's."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
import trio
import trio.testing
from openai._models import construct_type
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from inference_lab.api.agents import split_pieces
from inference_lab.api.text import placeholder_text
from inference_lab.core.config import load_deployment
from inference_lab.serve import ServeSettings
from tests.conftest import (
    CONFIGS,
    GPT,
    ServeFactory,
    Stream,
    chat_body,
    make_settings,
)
from tests.serve_util import split_frames

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "pattern": "^[a-z]+( [a-z]+)*$"},
        "filters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"field": {"type": "string"}, "value": {"type": "number"}},
                "required": ["field", "value"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["query", "filters"],
}


def tool(name: str, parameters: Any = None, *, strict: bool = True) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "strict": strict}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather", WEATHER), tool("search", SEARCH), tool("now")]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": {"type": "object", "properties": {}}}


def agent_body(content: str = "hello world", max_tokens: int = 256, **extra: Any) -> dict[str, Any]:
    return chat_body(content, max_tokens=max_tokens, **extra)


async def post_json(
    s: Any, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, Any]:
    response = await s.post(path, body)
    return response.status_code, json.loads(await response.get_data())


def call_tokens(calls: list[dict[str, Any]]) -> int:
    """Tokens a set of calls costs: one for each call's id and name, one per piece of its
    arguments."""
    return sum(1 + len(split_pieces(c["function"]["arguments"])) for c in calls)


def payloads(stream: Stream) -> list[Any]:
    return [
        "[DONE]" if p == b"[DONE]" else json.loads(p) for p in split_frames(stream.body_bytes())
    ]


def accumulate(stream: Stream, tools: Any = None) -> Any:
    """The openai SDK's own accumulation of a chat stream's chunks."""
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState(input_tools=tools or [])
    for payload in payloads(stream):
        if payload != "[DONE]":
            state.handle_chunk(construct_type(type_=ChatCompletionChunk, value=payload))
    return state.get_final_completion()


def settings_with(**kwargs: Any) -> ServeSettings:
    import attrs

    return attrs.evolve(make_settings(), **kwargs)


# -- tool calls ------------------------------------------------------------------------------


async def test_required_tool_choice_answers_with_valid_tool_calls(serve: ServeFactory) -> None:
    """``tool_choice: required``: tool calls whose arguments validate against their
    function's schema, ``finish_reason: tool_calls``, content null; usage counts one token
    per call plus one per argument piece."""
    async with serve() as s:
        for i in range(12):
            status, body = await post_json(
                s, agent_body(f"question {i}", tools=TOOLS, tool_choice="required")
            )
            assert status == 200
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            message = choice["message"]
            assert message["content"] is None
            calls = message["tool_calls"]
            assert 1 <= len(calls) <= 3
            assert len({c["function"]["name"] for c in calls}) == len(calls)
            for call in calls:
                assert call["type"] == "function" and call["id"].startswith("call_")
                schema = SCHEMAS[call["function"]["name"]]
                jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            assert body["usage"]["completion_tokens"] == call_tokens(calls)


async def test_named_tool_choice_calls_exactly_that_function(serve: ServeFactory) -> None:
    async with serve() as s:
        named = {"type": "function", "function": {"name": "search"}}
        for i in range(5):
            _, body = await post_json(s, agent_body(f"q{i}", tools=TOOLS, tool_choice=named))
            calls = body["choices"][0]["message"]["tool_calls"]
            assert [c["function"]["name"] for c in calls] == ["search"]


async def test_parallel_tool_calls_false_makes_one_call_per_answer(serve: ServeFactory) -> None:
    """With ``parallel_tool_calls`` false every tool answer is one call; allowed (the
    default), some answers call several tools at once."""
    counts: dict[bool, list[int]] = {True: [], False: []}
    async with serve() as s:
        for parallel in (True, False):
            for i in range(16):
                body = agent_body(
                    f"q{i}", tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel
                )
                _, answer = await post_json(s, body)
                counts[parallel].append(len(answer["choices"][0]["message"]["tool_calls"]))
    assert set(counts[False]) == {1}
    assert max(counts[True]) > 1


async def test_tool_choice_none_never_calls(serve: ServeFactory) -> None:
    async with serve() as s:
        for i in range(8):
            _, body = await post_json(
                s, agent_body(f"q{i}", max_tokens=4, tools=TOOLS, tool_choice="none")
            )
            message = body["choices"][0]["message"]
            assert "tool_calls" not in message
            assert message["content"] == "the of and to"
            assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("probability", [0.0, 0.5, 1.0])
async def test_auto_calls_a_tool_with_the_configured_probability(
    serve: ServeFactory, probability: float
) -> None:
    """``tool_choice: auto`` (the default with tools) on a fresh question a tool fits calls
    a tool with the chance ``--tool-call-probability``, and answers in prose otherwise."""
    calls = 0
    total = 40
    async with serve(settings_with(tool_call_probability=probability)) as s:
        for i in range(total):
            question = f"What is the weather in city {i}?"
            _, body = await post_json(s, agent_body(question, tools=TOOLS))
            message = body["choices"][0]["message"]
            if message.get("tool_calls"):
                calls += 1
                assert body["choices"][0]["finish_reason"] == "tool_calls"
            else:
                assert message["content"] == placeholder_text(256).rstrip(" ")
    if probability == 0.0:
        assert calls == 0
    elif probability == 1.0:
        assert calls == total
    else:
        assert 10 <= calls <= 30


def _after_calls(question: str, calls: int) -> list[dict[str, Any]]:
    """A conversation in which the assistant answered ``question`` with ``calls`` tool
    calls in a row, each answered by its result: the next answer follows a tool result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for k in range(calls):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": "sunny"})
    return messages


async def test_auto_tool_calls_follow_the_conversation(serve: ServeFactory) -> None:
    """With ``--tool-call-probability 1``: a fresh question no tool fits calls one in a
    quarter of answers; right after a tool result the chance is 0.4, after a second call
    0.2 (``api/tool_choice.py``), so an agent loop calls its tool a few times, then
    answers."""
    total = 120

    def called(body: Any) -> bool:
        return bool(body["choices"][0]["message"].get("tool_calls"))

    async with serve(settings_with(tool_call_probability=1.0)) as s:
        counts = {"no_fit": 0, "after_one": 0, "after_two": 0}
        for i in range(total):
            _, body = await post_json(s, agent_body(f"Tell me a joke number {i}", tools=TOOLS))
            counts["no_fit"] += called(body)
            for key, made in (("after_one", 1), ("after_two", 2)):
                messages = _after_calls(f"What is the weather in city {i}?", made)
                request = {**agent_body(tools=TOOLS), "messages": messages}
                _, body = await post_json(s, request)
                counts[key] += called(body)
    # binomial(120, p) within about 3.5 standard deviations of its mean
    assert 15 <= counts["no_fit"] <= 45  # p = 0.25
    assert 30 <= counts["after_one"] <= 66  # p = 0.4
    assert 10 <= counts["after_two"] <= 40  # p = 0.2


async def test_content_is_a_function_of_the_request_and_the_seed(serve: ServeFactory) -> None:
    """The same request gives the same arguments (streamed or not); another request or
    another ``--seed`` gives others. Only ids differ between identical requests."""

    def arguments(body: Any) -> list[str]:
        return [c["function"]["arguments"] for c in body["choices"][0]["message"]["tool_calls"]]

    named = {"type": "function", "function": {"name": "search"}}
    request = agent_body("weather in town", tools=TOOLS, tool_choice=named)
    async with serve(settings_with(seed=1)) as s:
        _, a = await post_json(s, request)
        _, b = await post_json(s, request)
        _, other = await post_json(s, {**request, "messages": [{"role": "user", "content": "x"}]})
        async with s.stream({**request, "stream": True}) as stream:
            await stream.read_all()
        streamed = accumulate(stream, TOOLS)
    async with serve(settings_with(seed=2)) as s:
        _, reseeded = await post_json(s, request)
    assert arguments(a) == arguments(b)
    assert (
        a["choices"][0]["message"]["tool_calls"][0]["id"]
        != b["choices"][0]["message"]["tool_calls"][0]["id"]
    )
    assert [c.function.arguments for c in streamed.choices[0].message.tool_calls] == arguments(a)
    assert arguments(other) != arguments(a)
    assert arguments(reseeded) != arguments(a)


async def test_streamed_tool_call_deltas_have_the_shapes_the_sdk_accumulates(
    serve: ServeFactory,
) -> None:
    """A streamed tool call: the role frame, then per engine token one frame -- a call's
    first token carries its index, id, type and name with empty arguments, each later one
    its index and one argument piece -- then ``finish_reason: tool_calls``, usage and
    ``[DONE]``. The SDK's own stream state rebuilds the non-streaming message."""
    request = agent_body("plan a trip", tools=TOOLS, tool_choice="required")
    async with serve() as s:
        _, whole = await post_json(s, request)
        body = {**request, "stream": True, "stream_options": {"include_usage": True}}
        async with s.stream(body) as stream:
            await stream.read_all()
    frames = payloads(stream)
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert frames[-1] == "[DONE]"
    usage = frames[-2]
    # the stream came second: it found the first request's whole prompt blocks cached
    # (all but the last prompt token's block, as vLLM admits: 64 positions a block)
    cached = usage["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert whole["usage"].pop("prompt_tokens_details")["cached_tokens"] == 0
    assert cached == (whole["usage"]["prompt_tokens"] - 1) // 64 * 64 > 0
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert frames[-3]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    tokens = frames[1:-3]
    assert len(tokens) == whole["usage"]["completion_tokens"]
    expected_calls = whole["choices"][0]["message"]["tool_calls"]
    at = 0
    for number, call in enumerate(expected_calls):
        opening = tokens[at]["choices"][0]["delta"]["tool_calls"]
        assert len(opening) == 1
        assert opening[0]["index"] == number
        assert set(opening[0]) == {"index", "id", "type", "function"}
        assert opening[0]["type"] == "function"
        assert opening[0]["function"] == {"name": call["function"]["name"], "arguments": ""}
        pieces = split_pieces(call["function"]["arguments"])
        for k, piece in enumerate(pieces):
            delta = tokens[at + 1 + k]["choices"][0]["delta"]["tool_calls"]
            assert delta == [{"index": number, "function": {"arguments": piece}}]
        at += 1 + len(pieces)
    assert at == len(tokens)
    final = accumulate(stream, TOOLS)
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected_calls
    ]
    for call in message.tool_calls:  # strict tools: the SDK parsed the arguments too
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


async def test_max_tokens_cuts_a_tool_call_as_a_real_server_would(serve: ServeFactory) -> None:
    """A budget smaller than the call: the arguments are the document's first pieces
    (truncated JSON), ``finish_reason: length``, usage = max_tokens."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = agent_body("x", tools=TOOLS, tool_choice=named)
    async with serve() as s:
        _, whole = await post_json(s, request)
        full = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        pieces = split_pieces(full)
        _, cut = await post_json(s, {**request, "max_tokens": 5})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "".join(pieces[:4])
    assert cut["usage"]["completion_tokens"] == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])


async def test_a_tool_schema_no_instance_satisfies_is_a_400_naming_the_tool(
    serve: ServeFactory,
) -> None:
    bad = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["n"],
    }
    async with serve() as s:
        status, body = await post_json(s, agent_body(tools=[TOOLS[0], tool("broken", bad)]))
        assert status == 400
        error = body["error"]
        assert error["code"] == "invalid_schema"
        assert error["param"] == "tools[1].function.parameters"
        assert "'broken'" in error["message"] and "properties/n" in error["message"]
        # whatever the choice: tool_choice none still checks every tool
        status, _ = await post_json(s, agent_body(tools=[tool("broken", bad)], tool_choice="none"))
        assert status == 400
        assert s.runtime().snapshot().admitted == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [tool("has space", WEATHER)]}, "tools[0].function.name"),
        ({"tools": [tool("a", WEATHER), tool("a", WEATHER)]}, "tools[1].function.name"),
        ({"tools": [tool("a", {"type": "string"})]}, "tools[0].function.parameters"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "("}, "guided_regex"),
        (
            {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
            "guided_json",
        ),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ],
)
async def test_bad_agent_fields_are_400s_naming_the_field(
    serve: ServeFactory, extra: dict[str, Any], param: str
) -> None:
    async with serve() as s:
        status, body = await post_json(s, agent_body(**extra))
        assert status == 400, body
        assert body["error"]["param"] == param
        assert s.runtime().snapshot().admitted == 0


# -- structured output -------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "extra",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": True},
            }
        },
        {"guided_json": PERSON},
        {"guided_json": json.dumps(PERSON)},
        {"structured_outputs": {"json": PERSON}},
    ],
)
async def test_json_schema_answers_validate_and_usage_is_their_length(
    serve: ServeFactory, extra: dict[str, Any]
) -> None:
    """``json_schema`` (OpenAI's and vLLM's spellings): the content is an instance of the
    schema, ``finish_reason: stop``, and ``completion_tokens`` is the document's length."""
    async with serve() as s:
        for i in range(5):
            _, body = await post_json(s, agent_body(f"p{i}", **extra))
            choice = body["choices"][0]
            content = choice["message"]["content"]
            jsonschema.validate(
                json.loads(content), PERSON, format_checker=jsonschema.FormatChecker()
            )
            assert choice["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == len(split_pieces(content))


async def test_json_object_choice_and_regex_outputs(serve: ServeFactory) -> None:
    async with serve() as s:
        _, body = await post_json(s, agent_body(response_format={"type": "json_object"}))
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
        _, body = await post_json(s, agent_body(structured_outputs={"json_object": True}))
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
        _, body = await post_json(s, agent_body(guided_choice=["yes", "no"]))
        assert body["choices"][0]["message"]["content"] in ("yes", "no")
        _, body = await post_json(s, agent_body(guided_regex=r"\d{3}-[A-Z]{2}"))
        content = body["choices"][0]["message"]["content"]
        assert len(content) == 6 and content[3] == "-" and content[:3].isdigit()
        _, body = await post_json(s, agent_body(response_format={"type": "text"}, max_tokens=2))
        assert body["choices"][0]["message"]["content"] == "the of"


async def test_a_structured_output_cut_by_max_tokens_is_truncated_json(serve: ServeFactory) -> None:
    request = agent_body(
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    )
    async with serve() as s:
        _, whole = await post_json(s, request)
        content = whole["choices"][0]["message"]["content"]
        _, cut = await post_json(s, {**request, "max_tokens": 3})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == "".join(split_pieces(content)[:3])
    assert cut["usage"]["completion_tokens"] == 3


async def test_a_workload_does_not_cut_json_answers(serve: ServeFactory, tmp_path: Any) -> None:
    """With ``--workload`` drawing 2-token answers, prose stops at 2 tokens but a tool
    call or a structured output runs to the end of its document: its content decides its
    length."""
    workload = tmp_path / "w.toml"
    workload.write_text(
        'arrival_pattern = "poisson"\narrival_rate = 1.0\nnum_requests = 1\nseed = 1\n'
        'input_len_dist = { type = "fixed", value = 10 }\n'
        'output_len_dist = { type = "fixed", value = 2 }\n'
    )
    async with serve(make_settings(workload=str(workload))) as s:
        _, prose = await post_json(s, agent_body(max_tokens=50))
        assert prose["usage"]["completion_tokens"] == 2
        _, called = await post_json(s, agent_body(tools=TOOLS, tool_choice="required"))
        assert called["choices"][0]["finish_reason"] == "tool_calls"
        calls = called["choices"][0]["message"]["tool_calls"]
        assert called["usage"]["completion_tokens"] == call_tokens(calls) > 2
        _, structured = await post_json(s, agent_body(guided_json=PERSON))
        assert structured["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(structured["choices"][0]["message"]["content"]), PERSON)


# -- reasoning ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("effort", "ratio"), [("low", 0.2), ("medium", 0.5), ("high", 0.8)])
async def test_reasoning_effort_splits_the_output(
    serve: ServeFactory, effort: str, ratio: float
) -> None:
    """On a reasoning model, the first ``floor(ratio x length)`` tokens are reasoning
    (placeholder words, under vLLM's ``reasoning`` and the older ``reasoning_content``),
    the rest the content; usage reports them as ``reasoning_tokens``; streamed deltas
    rebuild both."""
    length = 10
    reasoning = math.floor(ratio * length)
    request = agent_body(max_tokens=length, reasoning_effort=effort)
    async with serve() as s:
        _, body = await post_json(s, request)
        async with s.stream({**request, "stream": True}) as stream:
            await stream.read_all()
    message = body["choices"][0]["message"]
    text = placeholder_text(length).rstrip(" ")
    cut = len(placeholder_text(reasoning))
    assert message["reasoning"] == message["reasoning_content"] == text[:cut]
    assert message["content"] == text[cut:]
    assert body["usage"]["completion_tokens"] == length
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning}
    deltas = [p["choices"][0]["delta"] for p in payloads(stream)[1:-2]]
    assert len(deltas) == length
    assert [list(d) for d in deltas] == [["reasoning", "reasoning_content"]] * reasoning + [
        ["content"]
    ] * (length - reasoning)
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


async def test_reasoning_fields_follow_the_flag_and_include_reasoning(
    serve: ServeFactory,
) -> None:
    """``--no-reasoning-content`` sends ``reasoning`` only (message and deltas);
    ``include_reasoning: false`` (vLLM's field) sends no reasoning at all -- no field, no
    frames -- while usage still counts the reasoning tokens; a non-boolean is a 400."""
    request = agent_body(max_tokens=10, reasoning_effort="medium")
    async with serve(settings_with(reasoning_content=False)) as s:
        _, body = await post_json(s, request)
        async with s.stream({**request, "stream": True}) as stream:
            await stream.read_all()
        _, hidden = await post_json(s, {**request, "include_reasoning": False})
        async with s.stream({**request, "stream": True, "include_reasoning": False}) as quiet:
            await quiet.read_all()
        status, bad = await post_json(s, {**request, "include_reasoning": "no"})
    message = body["choices"][0]["message"]
    assert message["reasoning"] == placeholder_text(5) and "reasoning_content" not in message
    deltas = [p["choices"][0]["delta"] for p in payloads(stream)[1:-2]]
    assert [list(d) for d in deltas] == [["reasoning"]] * 5 + [["content"]] * 5
    assert "reasoning" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == message["content"]
    assert hidden["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    quiet_deltas = [p["choices"][0]["delta"] for p in payloads(quiet)[1:-2]]
    assert [list(d) for d in quiet_deltas] == [["content"]] * 5
    assert status == 400 and bad["error"]["param"] == "include_reasoning"


async def test_earlier_reasoning_is_accepted_under_both_names(serve: ServeFactory) -> None:
    """An assistant message may carry its reasoning as ``reasoning`` or as the older
    ``reasoning_content``; either is accepted (a string or null), anything else is a 400
    naming the field."""

    def conversation(**fields: Any) -> dict[str, Any]:
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", **fields},
            {"role": "user", "content": "and?"},
        ]
        return {**agent_body(max_tokens=4), "messages": messages}

    async with serve() as s:
        for fields in ({"reasoning": "hmm"}, {"reasoning_content": "hmm"}, {"reasoning": None}):
            status, _ = await post_json(s, conversation(**fields))
            assert status == 200, fields
        for key in ("reasoning", "reasoning_content"):
            status, body = await post_json(s, conversation(**{key: 5}))
            assert status == 400 and body["error"]["param"] == f"messages[1].{key}", body


async def test_gpt_oss_reasons_only_when_asked_and_qwen3_by_default(serve: ServeFactory) -> None:
    """The shipped gpt-oss configs reason when a request names an effort; Qwen3's reason
    by default (medium) until ``enable_thinking: false`` or effort ``none``."""
    qwen = load_deployment(CONFIGS / "Qwen3-30B-A3B.toml", "b200")
    settings = ServeSettings(deployments=(make_settings().deployments[0], qwen))
    async with serve(settings) as s:
        _, plain = await post_json(s, agent_body(max_tokens=4))
        assert "reasoning_content" not in plain["choices"][0]["message"]
        assert "completion_tokens_details" not in plain["usage"]
        qwen_body = {**agent_body(max_tokens=4), "model": "Qwen3-30B-A3B"}
        _, thinking = await post_json(s, qwen_body)
        assert thinking["choices"][0]["message"]["reasoning_content"] == "the of "
        assert thinking["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
        for off in (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning_effort": "none"},
        ):
            _, quiet = await post_json(s, {**qwen_body, **off})
            assert "reasoning_content" not in quiet["choices"][0]["message"]
            assert quiet["choices"][0]["message"]["content"] == "the of and to"


async def test_reasoning_comes_before_a_json_answer(serve: ServeFactory) -> None:
    """Before a JSON answer of D tokens, ``ceil(ratio x D / (1 - ratio))`` reasoning
    tokens; the whole answer is reasoning plus the complete document."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with serve() as s:
        _, plain = await post_json(s, agent_body(tools=TOOLS, tool_choice=named))
        _, body = await post_json(
            s, agent_body(tools=TOOLS, tool_choice=named, reasoning_effort="low")
        )
    document = call_tokens(plain["choices"][0]["message"]["tool_calls"])
    reasoning = math.ceil(0.2 * document / 0.8)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning}
    assert body["usage"]["completion_tokens"] == reasoning + document
    assert body["choices"][0]["message"]["reasoning_content"] == placeholder_text(reasoning)
    assert body["choices"][0]["finish_reason"] == "tool_calls"


async def test_n_choices_each_carry_the_tool_calls(serve: ServeFactory) -> None:
    async with serve() as s:
        _, body = await post_json(s, agent_body(tools=TOOLS, tool_choice="required", n=2))
    first, second = (c["message"]["tool_calls"] for c in body["choices"])
    assert [c["function"] for c in first] == [c["function"] for c in second]
    assert {c["id"] for c in first}.isdisjoint(c["id"] for c in second)
    assert body["usage"]["completion_tokens"] == 2 * call_tokens(first)


# -- the contract: pacing, saturation, leaks ----------------------------------------------------


def frame_times(stream: Stream) -> list[float]:
    """Arrival times of the token frames (every frame with a non-empty delta other than
    the role frame)."""
    times = []
    for t, data in stream.chunks:
        for payload in split_frames(data):
            if payload == b"[DONE]":
                continue
            frame = json.loads(payload)
            choices = frame.get("choices") or []
            if choices and choices[0].get("delta") and "role" not in choices[0]["delta"]:
                times.append(t)
    return times


async def test_tool_call_frames_are_paced_like_any_stream_of_their_length(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A streamed tool call's frames leave at the engine's step ends: the same virtual
    times as a plain stream of as many tokens and the same prompt."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = agent_body(tools=TOOLS, tool_choice=named, stream=True)
    async with serve() as s:
        t0 = trio.current_time()
        async with s.stream(request) as stream:
            await stream.read_all()
        agent_times = [t - t0 for t in frame_times(stream)]
        assert s.runtime().statistics().engine.finished == 1
    async with serve() as s:
        _, whole = await post_json(s, {**request, "stream": False})
        tokens = whole["usage"]["completion_tokens"]
        prompt_tokens = whole["usage"]["prompt_tokens"]
    async with serve() as s:
        plain = {
            "model": GPT,
            "prompt": list(range(prompt_tokens)),
            "max_tokens": tokens,
            "stream": True,
        }
        t0 = trio.current_time()
        async with s.stream(plain, path="/v1/completions") as stream:
            await stream.read_all()
        plain_times = [t - t0 for t in stream.token_times()]
    assert len(agent_times) == tokens == len(plain_times)
    assert agent_times == pytest.approx(plain_times, rel=1e-12, abs=1e-12)


async def test_agent_requests_get_529_before_any_response_starts(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the batch full and the queue at its bound, a tool-call request is refused
    with the exact 529 (JSON, x-should-retry false) and nothing is admitted."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with s.stream(chat_body(max_tokens=200, stream=True)) as running:
            await running.next_chunk()
            await running.next_chunk()
            async with s.stream(chat_body(max_tokens=3, stream=True)) as waiting:
                await trio.testing.wait_all_tasks_blocked()
                admitted = rt.snapshot().admitted
                for stream in (True, False):
                    body = agent_body(tools=TOOLS, tool_choice="required", stream=stream)
                    async with s.stream(body) as refused:
                        await refused.read_all()
                    assert refused.status == 529
                    assert refused.headers["content-type"] == "application/json"
                    assert refused.headers["x-should-retry"] == "false"
                    assert json.loads(refused.body_bytes())["error"]["code"] == "queue_saturated"
                assert rt.snapshot().admitted == admitted
                await waiting.read_all()
            await running.read_all()


async def test_a_dead_engine_is_a_503_for_agent_requests(serve: ServeFactory) -> None:
    async with serve() as s:
        s.runtime().kill()
        status, body = await post_json(s, agent_body(tools=TOOLS, tool_choice="required"))
        assert status == 503
        assert body["error"]["code"] == "engine_unavailable"


async def test_a_client_leaving_a_tool_call_stream_frees_its_slot(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        rt = s.runtime()
        body = agent_body(tools=TOOLS, tool_choice="required", stream=True, reasoning_effort="high")
        async with s.stream(body) as stream:
            await stream.next_chunk()
            await stream.next_chunk()
        await trio.testing.wait_all_tasks_blocked()
        snap = rt.snapshot()
        assert (snap.running, snap.queued, snap.aborted) == (0, 0, 1)
        assert rt.statistics().engine.kv_usage == 0.0


@pytest.mark.parametrize("key", ["response_format", "guided_json", "structured_outputs"])
async def test_completions_refuse_structured_output(serve: ServeFactory, key: str) -> None:
    """``/v1/completions`` does not follow a structured output: asking for one is a 400
    naming the field, not an answer that ignores it."""
    value: Any = {"type": "json_object"} if key == "response_format" else {"type": "object"}
    if key == "structured_outputs":
        value = {"json": {"type": "object"}}
    body = {"model": GPT, "prompt": "hi", "max_tokens": 2, key: value}
    async with serve() as s:
        status, error = await post_json(s, body, "/v1/completions")
        assert status == 400 and error["error"]["param"] == key
        status, _ = await post_json(s, {**body, key: None}, "/v1/completions")
        assert status == 200


async def test_a_stop_string_cuts_reasoning_and_content_alike(serve: ServeFactory) -> None:
    """Stop strings apply to the whole output, reasoning included (as vLLM applies them):
    neither part holds the stop string, and streamed deltas concatenate to both."""
    request = agent_body(max_tokens=20, stop=["of and"], reasoning_effort="high")
    async with serve() as s:
        _, body = await post_json(s, request)
        async with s.stream({**request, "stream": True}) as stream:
            await stream.read_all()
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    assert message["reasoning_content"] + message["content"] == "the "
    deltas = [p["choices"][0]["delta"] for p in payloads(stream)[1:-2]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_agent_flags_and_their_environment_variables() -> None:
    """``--tool-call-probability`` (0-1) and ``--embedding-dim`` (>= 1) parse as flags and
    as ``INFERENCE_LAB_*`` variables; a bad value is a usage error (flag) or a one-line
    ConfigError naming the variable."""
    import argparse

    from inference_lab.errors import ConfigError
    from inference_lab.serve import cli as serve_cli
    from inference_lab.serve import load_settings, settings_from_env

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--tool-call-probability", "0.25", "--embedding-dim", "64"])
    assert (args.tool_call_probability, args.embedding_dim) == (0.25, 64)
    defaults = parser.parse_args(["serve"])
    assert (defaults.tool_call_probability, defaults.embedding_dim) == (0.9, None)
    for bad in (["--tool-call-probability", "1.5"], ["--embedding-dim", "0"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["serve", *bad])
        assert info.value.code == 2
    config = str(CONFIGS / "gpt-oss-20b.toml")
    env = {
        "INFERENCE_LAB_CONFIG": config,
        "INFERENCE_LAB_TOOL_CALL_PROBABILITY": "0.75",
        "INFERENCE_LAB_EMBEDDING_DIM": "32",
    }
    settings = settings_from_env(env)
    assert (settings.tool_call_probability, settings.embedding_dim) == (0.75, 32)
    assert settings.embedding_size(settings.deployments[0]) == 32
    assert settings_from_env({"INFERENCE_LAB_CONFIG": config}).tool_call_probability == 0.9
    with pytest.raises(ConfigError, match="^INFERENCE_LAB_TOOL_CALL_PROBABILITY: must be"):
        settings_from_env({**env, "INFERENCE_LAB_TOOL_CALL_PROBABILITY": "often"})
    with pytest.raises(ConfigError, match="^INFERENCE_LAB_EMBEDDING_DIM: must be an integer"):
        settings_from_env({**env, "INFERENCE_LAB_EMBEDDING_DIM": "0"})
    with pytest.raises(ConfigError, match="tool_call_probability: must be a number in 0..1"):
        load_settings(config=config, tool_call_probability=-0.1)
