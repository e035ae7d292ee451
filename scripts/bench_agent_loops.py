"""Agent loops of real agent frameworks against ``inference-lab serve``: does every run end
with a final answer, and how many model calls does a run make?

Each framework runs ``--runs`` agents (``--concurrency`` at a time, after one run not
counted that warms up its imports and connections) with one tool that
fits the question (``get_weather``; each run asks about another city or day) against one server with its default answer lengths
and tool choice (``docs/agents.md#when-an-auto-answer-calls-a-tool``):

- ``agents-responses``: openai-agents, ``OpenAIResponsesModel`` (``POST /v1/responses``);
- ``agents-chat``: openai-agents, ``OpenAIChatCompletionsModel`` (chat completions);
- ``pydantic-ai``: pydantic-ai's ``OpenAIChatModel`` (chat completions);
- ``anthropic``: the ``anthropic`` SDK's tool loop by hand (``POST /v1/messages``).

It prints, per framework, the runs that ended with a non-empty final answer, the
distribution of model calls per run, the tool calls and output tokens per run, and the
median wall time of a run.
Needs the clients (not test extras; the ``clients`` extra has them, as ``make test-clients``'
``.venv-clients`` does): ``pip install openai-agents 'pydantic-ai-slim[openai]'``.

    python scripts/bench_agent_loops.py [--runs 50] [--concurrency 5] [--config gpt-oss-20b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import ServerProcess  # noqa: E402

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quebec", "Seoul", "Nairobi", "Rome")
WHEN = ("today", "tomorrow", "this weekend", "on Monday", "on Friday")
INSTRUCTIONS = "You answer questions about the weather. Use the tools you have."
#: A run that has not answered after this many model calls counts as not ending.
MAX_TURNS = 20


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"Sunny and 21 degrees in {city}."


class Run:
    """One agent run's outcome: model calls, tool calls, output tokens (over its calls),
    the final answer, wall time."""

    def __init__(
        self, calls: int, tools: int, output: int, answer: str | None, seconds: float
    ) -> None:
        self.calls = calls
        self.tools = tools
        self.output = output
        self.answer = answer
        self.seconds = seconds


Loop = Callable[[str, str, str], Awaitable[Run]]


def question(run: int) -> str:
    """Run ``run``'s question: 50 different ones (an answer is a function of its request,
    so runs that sent the same first request would all decide alike)."""
    return f"What is the weather in {CITIES[run % 10]} {WHEN[run // 10 % 5]}?"


async def agents_loop(url: str, model: str, ask: str, *, responses: bool) -> Run:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
    )

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    llm: Any = (
        OpenAIResponsesModel(model=model, openai_client=client)
        if responses
        else OpenAIChatCompletionsModel(model=model, openai_client=client)
    )
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[function_tool(get_weather)],
        model=llm,
    )
    start = time.perf_counter()
    result = await Runner.run(agent, ask, max_turns=MAX_TURNS)
    seconds = time.perf_counter() - start
    tools = sum(1 for item in result.new_items if item.type == "tool_call_item")
    answer = result.final_output if isinstance(result.final_output, str) else None
    await client.close()
    output = result.context_wrapper.usage.output_tokens
    return Run(len(result.raw_responses), tools, output, answer, seconds)


async def agents_responses(url: str, model: str, ask: str) -> Run:
    return await agents_loop(url, model, ask, responses=True)


async def agents_chat(url: str, model: str, ask: str) -> Run:
    return await agents_loop(url, model, ask, responses=False)


async def pydantic_ai_loop(url: str, model: str, ask: str) -> Run:
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    llm = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
    agent = Agent(llm, instructions=INSTRUCTIONS, tools=[get_weather])
    start = time.perf_counter()
    result = await agent.run(ask, usage_limits=UsageLimits(request_limit=MAX_TURNS))
    seconds = time.perf_counter() - start
    usage = result.usage if hasattr(result.usage, "requests") else result.usage()
    answer = result.output if isinstance(result.output, str) else None
    await client.close()
    return Run(usage.requests, usage.tool_calls, usage.output_tokens, answer, seconds)


async def anthropic_loop(url: str, model: str, ask: str) -> Run:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    tools: Any = [
        {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": ask}]
    calls = tool_calls = output = 0
    answer = None
    start = time.perf_counter()
    while calls < MAX_TURNS:
        message = await client.messages.create(
            model=model, max_tokens=512, system=INSTRUCTIONS, tools=tools, messages=messages
        )
        calls += 1
        output += message.usage.output_tokens
        uses = [block for block in message.content if block.type == "tool_use"]
        if message.stop_reason != "tool_use" or not uses:
            answer = "".join(b.text for b in message.content if b.type == "text") or None
            break
        tool_calls += len(uses)
        messages.append({"role": "assistant", "content": message.content})
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": get_weather(**use.input)}
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
    seconds = time.perf_counter() - start
    await client.close()
    return Run(calls, tool_calls, output, answer, seconds)


LOOPS: dict[str, Loop] = {
    "agents-responses": agents_responses,
    "agents-chat": agents_chat,
    "pydantic-ai": pydantic_ai_loop,
    "anthropic": anthropic_loop,
}


async def run_all(loop: Loop, url: str, model: str, runs: int, concurrency: int) -> list[Any]:
    """``runs`` runs of ``loop``, ``concurrency`` at a time; an exception is a run's result."""
    gate = asyncio.Semaphore(concurrency)

    async def one(run: int) -> Any:
        async with gate:
            try:
                return await loop(url, model, question(run))
            except Exception as exc:  # noqa: BLE001 - a failed run is reported, not raised
                return exc

    return await asyncio.gather(*(one(run) for run in range(runs)))


def summary(name: str, results: list[Any]) -> dict[str, Any]:
    runs = [r for r in results if isinstance(r, Run)]
    errors = [f"{type(r).__name__}: {str(r)[:120]}" for r in results if not isinstance(r, Run)]
    answered = [r for r in runs if r.answer and r.answer.strip()]
    calls = Counter(r.calls for r in runs)
    return {
        "framework": name,
        "runs": len(results),
        "final_answers": len(answered),
        "errors": errors[:5],
        "error_count": len(errors),
        "model_calls": dict(sorted(calls.items())),
        "model_calls_mean": round(statistics.fmean(r.calls for r in runs), 2) if runs else None,
        "tool_calls_mean": round(statistics.fmean(r.tools for r in runs), 2) if runs else None,
        "output_tokens_mean": round(statistics.fmean(r.output for r in runs), 1) if runs else None,
        "run_seconds_median": round(statistics.median(r.seconds for r in runs), 3)
        if runs
        else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per framework")
    parser.add_argument("--concurrency", type=int, default=5, help="runs in flight at once")
    parser.add_argument("--config", default="gpt-oss-20b", help="the served model's config")
    parser.add_argument("--hardware", default="b200")
    parser.add_argument(
        "--frameworks", default=",".join(LOOPS), help=f"comma-separated, of: {', '.join(LOOPS)}"
    )
    parser.add_argument("-o", "--output", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOOPS]
    if unknown or args.runs < 1 or args.concurrency < 1:
        print(
            f"bench_agent_loops: bad arguments ({', '.join(unknown) or 'counts'})", file=sys.stderr
        )
        return 2
    try:
        from agents import set_tracing_disabled

        set_tracing_disabled(True)  # no exporter: the runs stay on this machine
    except ImportError:
        pass
    server_args = ["--config", args.config, "--hardware", args.hardware]
    figures = []
    with ServerProcess(server_args) as server:
        model = json.loads(_get(server.url + "/v1/models"))["data"][0]["id"]
        for name in names:
            asyncio.run(run_all(LOOPS[name], server.url, model, 1, 1))  # warm-up, not counted
            results = asyncio.run(
                run_all(LOOPS[name], server.url, model, args.runs, args.concurrency)
            )
            row = summary(name, results)
            figures.append(row)
            print(
                f"{name:<17} final answers {row['final_answers']}/{row['runs']}  "
                f"model calls mean {row['model_calls_mean']}  {row['model_calls']}  "
                f"tool calls mean {row['tool_calls_mean']}  "
                f"output tokens mean {row['output_tokens_mean']}  "
                f"run median {row['run_seconds_median']} s"
                + (f"  errors {row['error_count']}: {row['errors'][:1]}" if row["errors"] else ""),
                flush=True,
            )
    if args.output is not None:
        args.output.write_text(json.dumps({"model": model, "figures": figures}, indent=1) + "\n")
    return 0 if all(r["final_answers"] == r["runs"] for r in figures) else 1


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - 127.0.0.1
        return str(response.read().decode())


if __name__ == "__main__":
    sys.exit(main())
