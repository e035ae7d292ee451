"""The pure AIMD controller: the rules in ``inference_lab/client/aimd.py``'s header, one test
per rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference_lab.client.aimd import AIMDController


def successes(c: AIMDController, n: int) -> int:
    for _ in range(n):
        c.on_success()
    return c.limit


def test_defaults_are_those_of_the_load_command() -> None:
    """Starting limit 1, window 8, backoff 0.5, ceiling 1024 (``LoadConfig``'s defaults)."""
    c = AIMDController()
    assert (c.limit, c.window, c.backoff, c.max_limit) == (1, 8, 0.5, 1024)


def test_additive_increase_after_each_full_window() -> None:
    """+1 after every `window` successes without a 529, not before."""
    c = AIMDController(initial=1, window=8)
    assert successes(c, 7) == 1
    assert successes(c, 1) == 2
    assert successes(c, 8) == 3
    assert successes(c, 80) == 13
    assert c.statistics().increases == 12


def test_multiplicative_decrease_on_529() -> None:
    """A 529 multiplies the limit by the backoff, rounded down."""
    c = AIMDController(initial=10, backoff=0.5)
    assert c.on_overload() == 5
    c = AIMDController(initial=11, backoff=0.5)
    assert c.on_overload() == 5
    c = AIMDController(initial=20, backoff=0.75)
    assert c.on_overload() == 15


def test_floor_is_one() -> None:
    """The limit never drops below 1, however many windows end in a 529."""
    c = AIMDController(initial=3, window=2)
    for _ in range(10):
        c.on_overload()
        successes(c, 2)  # close the window so the next 529 may cut again
    c.on_overload()
    assert c.limit == 1
    assert c.statistics().min_limit_seen == 1


def test_ceiling_is_max_concurrency() -> None:
    """The limit never rises above `max_limit`; the starting limit is clamped to it."""
    c = AIMDController(initial=3, max_limit=5, window=1)
    assert successes(c, 100) == 5
    assert AIMDController(initial=50, max_limit=5).limit == 5


def test_at_most_one_decrease_per_window() -> None:
    """529s right after a cut (requests sent before it) do not cut again; the window they
    fall in ends without an increase; the next window may cut again."""
    c = AIMDController(initial=32, window=4)
    assert c.on_overload() == 16
    assert c.on_overload() == 16
    assert c.on_overload() == 16
    assert successes(c, 4) == 16  # that window saw 529s: no increase
    assert c.on_overload() == 8  # a new window: cuts again
    assert c.statistics().decreases == 2
    assert c.statistics().overloads == 4


def test_a_new_window_starts_after_a_decrease() -> None:
    """Successes counted before a cut do not count towards the next increase."""
    c = AIMDController(initial=8, window=4)
    successes(c, 3)
    c.on_overload()  # 4, new window
    assert successes(c, 3) == 4
    assert successes(c, 1) == 5


def test_a_529_within_a_window_blocks_its_increase_only_once() -> None:
    """After a window with a cut and late 529s, a clean window increases again."""
    c = AIMDController(initial=8, window=2)
    c.on_overload()
    c.on_overload()
    assert successes(c, 2) == 4
    assert successes(c, 2) == 5


@pytest.mark.parametrize(
    "outcome",
    [
        "unavailable",
        "client_error",
        "server_error",
        "http_error",
        "stream_error",
        "connection_error",
        "timeout",
        "cancelled",
    ],
)
def test_503_and_other_errors_are_ignored(outcome: str) -> None:
    """Only 529 is an overload signal: a 503 (or any other failure) neither cuts the limit
    nor counts towards a window, in the middle of a window or right after a cut."""
    c = AIMDController(initial=4, window=3)
    successes(c, 2)
    before = c.statistics()
    for _ in range(20):
        assert c.on_outcome(outcome) == 4
    assert c.statistics() == before
    assert c.on_outcome("ok") == 5  # the window's third success, not the 23rd event
    c.on_outcome("overloaded")
    cut = c.statistics()
    for _ in range(20):
        c.on_outcome(outcome)
    assert c.statistics() == cut


def test_on_outcome_routes_ok_and_529() -> None:
    """``on_outcome`` maps "ok" to a success and "overloaded" (529) to an overload."""
    c = AIMDController(initial=4, window=1)
    assert c.on_outcome("ok") == 5
    assert c.on_outcome("overloaded") == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial": 0}, "initial"),
        ({"max_limit": 0}, "max_limit"),
        ({"window": 0}, "window"),
        ({"backoff": 1.0}, "backoff"),
        ({"backoff": 0.0}, "backoff"),
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    """Nonsense parameters fail at construction with a message naming the parameter."""
    with pytest.raises(ValueError, match=message):
        AIMDController(**kwargs)  # type: ignore[arg-type]


@given(st.lists(st.sampled_from(["ok", "529"]), max_size=400), st.integers(1, 64))
def test_limit_always_within_bounds(events: list[str], ceiling: int) -> None:
    """Whatever the sequence of outcomes, 1 <= limit <= max_limit."""
    c = AIMDController(initial=1, max_limit=ceiling, window=3)
    for e in events:
        limit = c.on_success() if e == "ok" else c.on_overload()
        assert 1 <= limit <= ceiling
