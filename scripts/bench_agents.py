"""Benchmark the CPU an agent answer costs the server's event loop, in-process.

The content of tool calls and structured outputs is generated synchronously when a request
is parsed, and agent streams encode their frames per token: both run on the one event loop
that paces every model. This prints the median microseconds of

- planning an answer (``plan_answer``): a small tool call, a structured output of a
  Pydantic model's strict schema (``$defs``, ``anyOf``, formats, patterns), and five
  tools of which the answer calls some;
- one streamed token: the plain chat encoder's against the agent encoder's (prose with
  reasoning, tool-call arguments) and the Responses API's events;
- one embedding vector's part of the body (2,880 floats, ``float`` and ``base64``);
- the routes vLLM clients added (issue 43): a Messages request of a 10-turn tool
  conversation parsed and one of its streamed tokens, lm-eval-harness's scoring request
  (64 prompts of 200 token ids, ``echo`` with ``logprobs``, ``max_tokens`` 0) parsed and
  its body built (sent in pieces with a checkpoint between), a rerank of 100 documents
  parsed and its body built.

    python scripts/bench_agents.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import pydantic
from openai.lib._pydantic import to_strict_json_schema

from inference_lab.api.agent_encoding import ChatAgentEncoder
from inference_lab.api.agents import (
    AgentRequest,
    AnswerPlan,
    FunctionTool,
    StructuredOutput,
    plan_answer,
)
from inference_lab.api.completion_batch import PromptResult, batch_pieces
from inference_lab.api.embeddings import embedding_vector, encode_vector
from inference_lab.api.encoding import StreamEncoder
from inference_lab.api.messages_encoding import MessageIds, MessagesEncoder
from inference_lab.api.messages_request import parse_messages_request
from inference_lab.api.pooling import parse_rerank_request, pooling_pieces
from inference_lab.api.requests import ParsedRequest, parse_completion_requests
from inference_lab.api.responses_api import ResponseIds, ResponsesEncoder
from inference_lab.api.responses_request import parse_responses_request

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


class Address(pydantic.BaseModel):
    street: str
    zip_code: str = pydantic.Field(pattern=r"^\d{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=2, max_length=40)
    age: int = pydantic.Field(ge=0, le=130)
    email: str | None
    kind: Literal["customer", "employee"]
    tags: list[str]
    address: Address
    previous: list[Address]
    born: datetime.date
    score: float = pydantic.Field(gt=0, lt=1)


def median_us(call: Callable[[], Any], repeat: int) -> float:
    for _ in range(5):
        call()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def per_token_us(make: Callable[[], Any], tokens: int, repeat: int) -> float:
    """Median microseconds per token of encoding ``tokens`` tokens one call each."""

    def run() -> None:
        encoder = make()
        for i in range(tokens):
            encoder.tokens(i, i + 1)

    return median_us(run, max(1, repeat // 10)) / tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="timed runs per figure")
    args = parser.parse_args()
    if args.repeat < 1:
        print("bench_agents: --repeat must be at least 1", file=sys.stderr)
        return 2
    repeat = args.repeat
    weather = FunctionTool(name="get_weather", parameters=WEATHER, param="tools")
    person = StructuredOutput(
        kind="json_schema", param="response_format", schema=to_strict_json_schema(Person)
    )
    five = tuple(
        FunctionTool(name=f"tool_{i}", parameters=WEATHER, param="tools") for i in range(5)
    )
    seeds = iter(range(10**9))

    def plan(agent: AgentRequest) -> Callable[[], Any]:
        return lambda: plan_answer(agent, random.Random(next(seeds)))

    print(f"bench_agents: median microseconds, {repeat} runs each")
    print("planning an answer (schema -> instance, pieces)")
    rows = [
        (
            "one tool call (3 properties)",
            plan(AgentRequest(tools=(weather,), tool_choice="required")),
        ),
        ("structured output (Pydantic model)", plan(AgentRequest(output=person))),
        ("five tools, auto", plan(AgentRequest(tools=five))),
    ]
    for label, call in rows:
        print(f"  {label:<40} {median_us(call, repeat):9.1f} us")

    parsed = ParsedRequest(
        kind="chat",
        model="m",
        prompt_tokens=5,
        max_tokens=200,
        stream=True,
        include_usage=False,
        priority=0,
    )
    call_plan = plan_answer(AgentRequest(output=person), random.Random(1))
    assert call_plan is not None and call_plan.text is not None
    tokens = len(call_plan.text)
    tool_plan = plan_answer(
        AgentRequest(tools=(weather,), tool_choice="required"), random.Random(2)
    )
    assert tool_plan is not None
    ids = [["call_x"] * len(tool_plan.calls)]

    def chat(plan: AnswerPlan, length: int) -> Callable[[], Any]:
        def make() -> ChatAgentEncoder:
            encoder = ChatAgentEncoder(parsed, plan, request_id="r", created=0, call_ids=ids)
            encoder.bind(length)
            return encoder

        return make

    responses_request = parse_responses_request({"model": "m", "input": "hi"}, 200)

    def responses(plan: AnswerPlan, length: int) -> Callable[[], Any]:
        def make() -> ResponsesEncoder:
            encoder = ResponsesEncoder(
                responses_request, plan, ResponseIds.new(len(plan.calls)), created_at=0
            )
            encoder.bind(length)
            encoder.opening()
            return encoder

        return make

    def plain() -> StreamEncoder:
        encoder = StreamEncoder(parsed, request_id="r", created=0)
        encoder.prepare()
        return encoder

    print("one streamed token (frame encoding)")
    reasoning = AnswerPlan(ratio=0.5)
    figures = [
        ("plain chat stream (StreamEncoder)", plain, 200),
        ("chat, prose with reasoning", chat(reasoning, 200), 200),
        ("chat, structured output pieces", chat(call_plan, tokens), tokens),
        ("chat, tool-call arguments", chat(tool_plan, tool_plan.fixed or 1), tool_plan.fixed or 1),
        ("Responses API, prose with reasoning", responses(reasoning, 200), 200),
        ("Responses API, structured output", responses(call_plan, tokens), tokens),
    ]
    for label, make, count in figures:
        print(f"  {label:<40} {per_token_us(make, count, repeat):9.2f} us")

    print("one embedding vector (2,880 floats)")
    key = iter(range(10**9))
    vector = embedding_vector(0, "m", b"x", 2880)
    for label, call in [
        ("draw (seeded unit vector)", lambda: embedding_vector(0, "m", b"%d" % next(key), 2880)),
        ("encode as float", lambda: encode_vector(vector, "float")),
        ("encode as base64", lambda: encode_vector(vector, "base64")),
    ]:
        print(f"  {label:<40} {median_us(call, repeat):9.1f} us")
    new_routes(repeat)
    return 0


def tool_conversation(turns: int) -> dict[str, Any]:
    """A Messages body: ``turns`` rounds of question, tool use and tool result."""
    messages: list[Any] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"What is the weather in city {i}?"})
        use = {
            "type": "tool_use",
            "id": f"toolu_{i}",
            "name": "get_weather",
            "input": {"city": "x"},
        }
        messages.append({"role": "assistant", "content": [use]})
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "Sunny."}
        messages.append({"role": "user", "content": [result]})
    messages.append({"role": "user", "content": "And tomorrow?"})
    tool = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}
    return {"model": "m", "max_tokens": 200, "tools": [tool], "messages": messages}


def new_routes(repeat: int) -> None:
    """The routes vLLM clients added: a request's parse and body (or one token)."""
    print("the routes vLLM clients added (per request, or per streamed token)")
    body = tool_conversation(10)
    request = parse_messages_request(body)
    plan = AnswerPlan(ratio=0.5)

    def messages_stream() -> MessagesEncoder:
        encoder = MessagesEncoder(request, plan, MessageIds(0))
        encoder.bind(200)
        encoder.opening()
        return encoder

    scoring = {
        "model": "m",
        "prompt": [list(range(200))] * 64,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
    }

    requests = parse_completion_requests(scoring, 16)
    results = [PromptResult(completion_tokens=0, finish_reason="length", cached_tokens=0)]

    def score_body() -> None:
        b"".join(batch_pieces(requests, results * len(requests), request_id="c", created=0))

    documents = [" ".join(f"word{(i * 7 + j) % 500}" for j in range(40)) for i in range(100)]
    rerank = {"model": "m", "query": "word1 word2 word3 word4", "documents": documents}
    parsed = parse_rerank_request(rerank)
    rows = [
        ("Messages: parse a 10-turn tool conversation", lambda: parse_messages_request(body)),
        ("scoring: parse 64 x 200 token ids", lambda: parse_completion_requests(scoring, 16)),
        ("scoring: body, 12,800 echoed logprobs", score_body),
        ("rerank: parse 100 documents of 40 words", lambda: parse_rerank_request(rerank)),
        (
            "rerank: score 100 pairs, body",
            lambda: b"".join(pooling_pieces(parsed, seed=0, created=0, dim=1)),
        ),
    ]
    for label, call in rows:
        print(f"  {label:<40} {median_us(call, max(1, repeat // 3)):9.1f} us")
    print(
        f"  {'Messages: one streamed token':<40} {per_token_us(messages_stream, 200, repeat):9.2f} us"
    )


if __name__ == "__main__":
    sys.exit(main())
