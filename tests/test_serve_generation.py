"""One request must never stall the server (issue 45): the hostile schemas and patterns
of the issue, each answered or refused within the work budget (``generate/budget.py``), the
event loop's share of it bounded, and the rest in a worker thread that ``/health`` does
not wait for (``serve/generation.py``)."""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

import inference_lab.serve.agents as serve_agents
from inference_lab.api import agents as api_agents
from inference_lab.api.answer_bounds import check_answer_bytes
from inference_lab.errors import ApiError
from inference_lab.generate.budget import (
    BYTES_PER_UNIT,
    INLINE_WORK,
    MAX_WORK,
    PAUSE_UNITS,
    Budget,
    OutOfWork,
)
from inference_lab.serve.generation import INLINE_BODY, plan_off_loop
from tests.conftest import GPT, ServeFactory, chat_body


def structured(schema: Any, **extra: Any) -> dict[str, Any]:
    spec = {"name": "out", "schema": schema}
    return chat_body(response_format={"type": "json_schema", "json_schema": spec}, **extra)


async def post(s: Any, body: dict[str, Any]) -> tuple[int, Any]:
    response = await s.post("/v1/chat/completions", body)
    return response.status_code, json.loads(await response.get_data())


class Recorder:
    """Wraps ``plan_answer`` as the serve layer calls it: each budget it was given, and
    how that attempt ended (``"ok"``, or the ``OutOfWork`` / error it raised)."""

    def __init__(self) -> None:
        self.attempts: list[tuple[Budget, str]] = []
        self.real = api_agents.plan_answer

    def __call__(self, *args: Any, budget: Budget, **kwargs: Any) -> Any:
        try:
            plan = self.real(*args, budget=budget, **kwargs)
        except OutOfWork as exc:
            self.attempts.append((budget, exc.what))
            raise
        except Exception as exc:
            self.attempts.append((budget, type(exc).__name__))
            raise
        self.attempts.append((budget, "ok"))
        return plan


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    record = Recorder()
    monkeypatch.setattr(serve_agents, "plan_answer", record)
    return record


A_LOT = "a" * 5_000 + "!"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        # re.search backtracks for minutes; the bounded matcher reads each state once
        (
            structured({"type": "string", "enum": [A_LOT], "pattern": "^(a+)+$"}),
            400,
            "no value of enum / const satisfies the other keywords",
        ),
        (
            structured({"type": "string", "enum": [A_LOT, "aaa"], "pattern": "^(a+)+$"}),
            200,
            None,
        ),
        # 5.6 s and x5 per +2 in the count with re; no string matches
        (
            chat_body(guided_regex="(a|a){20}(?!)"),
            400,
            "cannot generate a string matching pattern '(a|a){20}(?!)'",
        ),
        # hours with the quadratic enum scan
        (structured({"type": "string", "enum": [f"v{i}" for i in range(100_000)]}), 200, None),
        # 16-180 s; the program bound refuses it before anything runs
        (
            chat_body(guided_regex="(?=a){3000000}"),
            400,
            "its program (repeats expanded) passes 50,000 instructions",
        ),
        (
            structured(
                {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "string"} for i in range(10_000)},
                    "required": [f"p{i}" for i in range(10_000)],
                }
            ),
            400,
            "schema/required: 10,000 properties are required",
        ),
        # a ~300-byte request for a 768 MB reply: refused before generating
        (
            structured({"type": "string", "minLength": 6_000_000, "pattern": "a"}, n=128),
            400,
            "schema/minLength: its instances run past the 131,072 bytes",
        ),
        # polynomial of high degree with a back-reference: the budget refuses it
        (
            structured({"type": "string", "enum": ["a" * 200], "pattern": r"^(a*)(a*)(a*)(a*)\4b"}),
            400,
            "schema/pattern: generating an instance here takes more than this server's work "
            "budget (1,000,000 steps",
        ),
    ],
)
async def test_the_issue_s_hostile_requests_are_answered_within_the_budget(
    serve: ServeFactory,
    recorder: Recorder,
    body: dict[str, Any],
    status: int,
    fragment: str | None,
) -> None:
    """Each case ends in a 200 or a 400 naming the schema path, having held the event loop
    for at most INLINE_WORK units (the first attempt, for a body up to INLINE_BODY) and
    the worker thread for at most MAX_WORK; ``/health`` answers afterwards."""
    async with serve() as s:
        got, answer = await post(s, body)
        assert got == status, answer
        if fragment is not None:
            assert fragment in answer["error"]["message"], answer["error"]["message"]
            assert answer["error"]["param"] in (
                "guided_regex",
                "response_format.json_schema.schema",
            )
        rest = recorder.attempts
        if len(json.dumps(body)) <= INLINE_BODY:  # (a larger body goes to the thread at once)
            (inline, what), *rest = rest
            assert inline.limit == INLINE_WORK
            assert what != "inline" or rest, recorder.attempts  # an inline run out moved on
        for budget, _ in rest:
            assert budget.limit == MAX_WORK and budget.spent <= MAX_WORK + 1024
            assert budget.pause is not None  # (the thread lets go of the GIL)
        assert (await s.client.get("/health")).status_code == 200


async def test_a_small_tool_schema_is_planned_on_the_event_loop(
    serve: ServeFactory, recorder: Recorder
) -> None:
    """Rule 1 of generation: a tool call's small schema never needs a thread."""
    tool = {
        "type": "function",
        "function": {
            "name": "w",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    }
    async with serve() as s:
        got, _ = await post(s, chat_body(tools=[tool], tool_choice="required"))
        assert got == 200
    assert [what for _, what in recorder.attempts] == ["ok"]


async def test_health_answers_while_a_plan_holds_the_worker_thread(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread path does not hold the event loop: while a plan is held in its worker
    thread (deterministically, by an event), ``/health`` and a plain completion are
    answered; the plan then finishes and its request is answered."""
    started, release = threading.Event(), threading.Event()
    real = api_agents.plan_answer

    def held(*args: Any, budget: Budget, **kwargs: Any) -> Any:
        if budget.limit == INLINE_WORK:
            raise OutOfWork("inline")
        started.set()
        release.wait(30)
        return real(*args, budget=budget, **kwargs)

    monkeypatch.setattr(serve_agents, "plan_answer", held)
    results: list[int] = []
    async with serve() as s:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def slow() -> None:
                    results.append((await post(s, chat_body(guided_regex="[a-z]{3}")))[0])

                nursery.start_soon(slow)
                await trio.to_thread.run_sync(started.wait)
                assert (await s.client.get("/health")).status_code == 200
                assert (await post(s, chat_body(max_tokens=2)))[0] == 200
                assert results == []  # the held plan has not answered yet
                release.set()
    assert results == [200]


async def test_a_cancelled_plan_stops_its_thread() -> None:
    """Rule 3 of generation: cancelling the planning task cancels its budget, and the
    thread's next spend ends it."""
    ended = threading.Event()
    how: list[str] = []

    def endless(budget: Budget) -> Any:
        if budget.limit == INLINE_WORK:
            raise OutOfWork("inline")
        try:
            while True:
                budget.spend(0)
        except OutOfWork as exc:
            how.append(exc.what)
            ended.set()
            raise

    with trio.move_on_after(0.05):
        await plan_off_loop(endless)
    assert await trio.to_thread.run_sync(ended.wait, 10)
    assert how == ["cancelled"]


@pytest.mark.parametrize(
    ("make", "param", "fragment"),
    [
        (
            lambda: chat_body(guided_choice=["x" * 200_000], n=128),
            "guided_choice",
            "its answer runs past 131,072 bytes (with n = 128",
        ),
        (
            lambda: structured(
                {"type": "array", "items": {"type": "string", "minLength": 30_000}, "minItems": 40},
                n=16,
            ),
            "response_format.json_schema.schema",
            "its instances run past the 1,048,576 bytes",
        ),
    ],
)
async def test_reply_bytes_are_bounded_across_n(
    serve: ServeFactory, make: Callable[[], dict[str, Any]], param: str, fragment: str
) -> None:
    """A chosen string or a document that is one token per letter run is bounded by its
    bytes across ``n`` (answer bounds Rule 2), before anything is generated or admitted."""
    async with serve() as s:
        got, answer = await post(s, make())
        assert got == 400 and answer["error"]["param"] == param, answer
        assert fragment in answer["error"]["message"], answer["error"]["message"]
        assert s.runtime(GPT).snapshot().admitted == 0


def test_several_calls_within_their_bounds_may_be_too_many_together() -> None:
    """Three tool calls of 100 KB each fit the per-document bound at n = 128 (131,072
    bytes), but not the answer's: 38 MB across the choices is a 400 naming ``n``."""
    with pytest.raises(ApiError) as info:
        check_answer_bytes(["x" * 100_000] * 3, 128, "tools")
    assert info.value.param == "n" and "38,400,000 bytes across n = 128" in info.value.message
    check_answer_bytes(["x" * 100_000] * 3, 16, "tools")  # 4.8 MB: fine


def test_a_budget_counts_units_and_bytes_and_pauses() -> None:
    """Budget Rules 1-4: the limit's kind names the exhaustion; bytes count as work too;
    ``pause`` is called every PAUSE_UNITS units; a cancelled budget stops."""
    pauses: list[int] = []
    budget = Budget(work=1_000, output_bytes=160, pause=lambda: pauses.append(budget.spent))
    for _ in range(999):
        budget.spend()
    assert pauses == [PAUSE_UNITS * k for k in range(1, 999 // PAUSE_UNITS + 1)]
    with pytest.raises(OutOfWork) as info:
        budget.spend(2)
    assert info.value.what == "work"
    small = Budget(output_bytes=160)
    small.spend_bytes(160)
    assert small.spent == 160 // BYTES_PER_UNIT
    with pytest.raises(OutOfWork) as info:
        small.spend_bytes(1)
    assert info.value.what == "bytes"
    inline = Budget(inline_work=INLINE_WORK)
    with pytest.raises(OutOfWork) as info:
        inline.spend(INLINE_WORK + 1)
    assert info.value.what == "inline"
    cancelled = Budget()
    cancelled.cancel()
    with pytest.raises(OutOfWork) as info:
        cancelled.spend()
    assert info.value.what == "cancelled"


CONTRADICTION = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
    "required": ["n"],
}


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        # past INLINE_BODY: planned in the thread
        (chat_body(guided_regex="b" + "a" * 100_000), "32,768"),
        # on the event loop, retried attempts each keeping the last error
        (
            chat_body(
                tools=[{"type": "function", "function": {"name": "f", "parameters": CONTRADICTION}}]
            ),
            "no number lies between the bounds",
        ),
    ],
)
async def test_a_refusal_holds_nothing_in_a_cycle(
    serve: ServeFactory, body: dict[str, Any], fragment: str
) -> None:
    """Rule 5 of generation and of instances: a 400 reaches the client without the plan's
    tracebacks and kept errors without theirs, so no reference cycle keeps the request
    (its body, its schema) alive until the cyclic collector runs (100 refused 1.5 MB
    patterns held 360 MB). With the collector off, a refusal leaves no error behind."""
    async with serve() as s:
        assert (await post(s, body))[0] == 400
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            status, answer = await post(s, body)
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, BaseException)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert status == 400 and fragment in answer["error"]["message"]
    assert left == []
