"""Whether an ``auto`` answer calls a tool (``api/tool_choice.py``): the chance follows the
conversation -- high on a fresh question a tool fits, low after a tool's result and lower
with each further call -- and the tool fits by its name, description and parameters."""

from __future__ import annotations

import pytest

from inference_lab.api.agent_request import chat_turn, parse_chat_agent
from inference_lab.api.agents import AnswerPlan, content_rng, plan_answer
from inference_lab.api.tool_choice import (
    AFTER_TOOL,
    DECAY,
    NO_FIT,
    Turn,
    call_probability,
    conversation_turn,
    tool_words,
    tools_fit,
)

WEATHER = tool_words(
    {
        "name": "get_weather",
        "description": "Current conditions for a place",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
)
RECIPES = tool_words({"name": "searchRecipes", "parameters": None})


def test_tool_words_split_names_and_drop_stop_words() -> None:
    assert WEATHER == {"weather", "current", "conditions", "place", "city"}
    assert RECIPES == {"search", "recipes"}
    assert tool_words({"name": "HTTPServer_status"}) == {"http", "server", "status"}


@pytest.mark.parametrize(
    ("question", "fits"),
    [
        ("What's the weather in Paris?", True),
        ("Which city is warmest?", True),  # a parameter's name
        ("Find me a recipe for soup", True),  # recipe / recipes share their first 4 letters
        ("Tell me a joke", False),
        ("", False),
        ("get the", False),  # stop words only
    ],
)
def test_a_tool_fits_a_question_that_shares_a_content_word(question: str, fits: bool) -> None:
    assert tools_fit(question, [WEATHER, RECIPES]) is fits


def test_the_turn_is_read_from_the_messages() -> None:
    """The last user message is the question; tool calls since it count; a tool result
    last means the answer follows a tool result."""
    messages = [
        ("user", "old question", 0),
        ("assistant", "", 2),
        ("tool", "r", 0),
        ("user", "weather?", 0),
        ("assistant", "", 1),
        ("tool", "sunny", 0),
        ("assistant", "", 1),
        ("tool", "rain", 0),
    ]
    assert conversation_turn(messages) == Turn(after_tool=True, calls=2, question="weather?")
    assert conversation_turn(messages[:4]) == Turn(after_tool=False, calls=0, question="weather?")
    assert conversation_turn([]) == Turn()
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "weather "}, {"text": "now"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "a"},
    ]
    assert chat_turn(chat) == Turn(after_tool=True, calls=2, question="weather now")


def test_the_chance_follows_the_conversation() -> None:
    base = 0.9
    fresh = Turn(question="What's the weather?")
    assert call_probability(fresh, [WEATHER], base) == base
    assert call_probability(Turn(question="a joke"), [WEATHER], base) == base * NO_FIT
    after = [call_probability(Turn(after_tool=True, calls=k), [WEATHER], base) for k in (1, 2, 3)]
    assert after == [base * AFTER_TOOL, base * AFTER_TOOL * DECAY, base * AFTER_TOOL * DECAY**2]
    # a result with no call counted (a client's own history) is read as after one call
    assert call_probability(Turn(after_tool=True), [WEATHER], base) == base * AFTER_TOOL


def _agent_loop(seed: int, max_rounds: int = 12) -> int:
    """Model calls until a prose answer, planning each turn as the server does."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages: list[dict[str, object]] = [
        {"role": "user", "content": f"What's the weather in city {seed}?"}
    ]
    for round_ in range(1, max_rounds + 1):
        raw = {"model": "m", "messages": messages, "tools": tools}
        plan = plan_answer(parse_chat_agent(raw), content_rng(0, raw), tool_call_probability=0.9)
        assert isinstance(plan, AnswerPlan | None)
        if plan is None or not plan.calls:
            return round_
        calls = [{"id": f"c{round_}", "type": "function", "function": {"name": "get_weather"}}]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": f"c{round_}", "content": "sunny"})
    return max_rounds + 1


def test_an_agent_loop_calls_a_few_times_then_answers() -> None:
    """Over 400 loops the model calls: once (a direct answer) in about a tenth, twice in
    about half, more rarely more, and every loop answers within six calls. The mean is
    1 + 0.9 x (1 + 0.36 + 0.36 x 0.18 + ...) = 2.28 model calls."""
    rounds = [_agent_loop(seed) for seed in range(400)]
    assert max(rounds) <= 6
    assert 2.1 < sum(rounds) / len(rounds) < 2.45
    share_direct = rounds.count(1) / len(rounds)
    assert 0.05 < share_direct < 0.16


def test_the_decision_is_a_function_of_the_request() -> None:
    """The same body draws the same decision (``content_rng``); other bodies draw their
    own, so both outcomes occur at a chance of one half."""

    def decide(city: str) -> bool:
        raw = {
            "model": "m",
            "messages": [{"role": "user", "content": f"weather in {city}?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        }
        plan = plan_answer(parse_chat_agent(raw), content_rng(3, raw), tool_call_probability=0.5)
        return plan is not None and bool(plan.calls)

    assert [decide("Oslo") for _ in range(5)] == [decide("Oslo")] * 5
    outcomes = {decide(f"city {i}") for i in range(50)}
    assert outcomes == {True, False}
