"""``generate/regex.py``: clients' patterns matched in bounded work, compared with Python's own
``re.search`` (the semantics JSON Schema ``pattern`` has here) on generated patterns and
texts; the bounds of its Rule 3 and the cache of its Rule 4."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_lab.generate import regex as regex_module
from inference_lab.generate.budget import Budget, OutOfWork
from inference_lab.generate.regex import (
    MAX_PATTERN_LENGTH,
    PatternError,
    Regex,
    cache_size,
    compile_regex,
)

ATOMS = ["a", "b", ".", "[ab]", "[^a]", r"\w", r"\d", r"\s", r"\b", "^", "$", "(?i:A)", "\n"]


@st.composite
def patterns(draw: st.DrawFn, depth: int = 0) -> str:
    """A small pattern over ``a``, ``b`` and newlines, with every construct the matcher
    has: groups, alternation, greedy / lazy / possessive repeats, look-arounds, atomic
    groups, back-references and conditionals (only to the group 1 the pattern opens)."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 11 if depth < 2 else 0))
        if kind == 0:
            parts.append(draw(st.sampled_from(ATOMS)))
        elif kind == 1:
            parts.append(f"(?:{draw(patterns(depth + 1))}|{draw(patterns(depth + 1))})")
        elif kind in (2, 3):
            quant = draw(st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}"]))
            mode = draw(st.sampled_from(["", "?", "+"]))
            parts.append(f"(?:{draw(patterns(depth + 1))}){quant}{mode}")
        elif kind == 4:
            parts.append(f"(?={draw(patterns(depth + 1))})")
        elif kind == 5:
            parts.append(f"(?!{draw(patterns(depth + 1))})")
        elif kind == 6:
            parts.append(draw(st.sampled_from(["(?<=a)", "(?<!b)", "(?<=ab)", "(?<![ab]a)"])))
        elif kind == 7:
            parts.append(f"(?>{draw(patterns(depth + 1))})")
        else:
            parts.append(draw(st.sampled_from(ATOMS)))
    return "".join(parts)


@st.composite
def grouped(draw: st.DrawFn) -> str:
    """A pattern opening group 1 and referring to it (back-reference or conditional)."""
    head = draw(patterns())
    tail = draw(st.sampled_from([r"\1", r"(?(1)a|b)", r"(?(1)\1)", r"\1+"]))
    optional = draw(st.sampled_from(["", "?"]))
    return f"({head}){optional}{draw(patterns())}{tail}"


TEXTS = st.text(alphabet="abAB1 \n", max_size=12)


def _agrees(pattern: str, text: str) -> None:
    try:
        compiled = re.compile(pattern)
    except re.error:
        with pytest.raises(PatternError):
            Regex(pattern)
        return
    budget = Budget()
    assert Regex(pattern).search(text, budget) == (compiled.search(text) is not None), (
        pattern,
        text,
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patterns(), TEXTS)
def test_search_agrees_with_re(pattern: str, text: str) -> None:
    _agrees(pattern, text)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped(), TEXTS)
def test_search_with_groups_agrees_with_re(pattern: str, text: str) -> None:
    _agrees(pattern, text)


@pytest.mark.parametrize(
    ("pattern", "text", "found"),
    [
        (r"(?m)^b$", "a\nb\nc", True),
        (r"^b$", "a\nb\nc", False),
        (r"x$", "x\n", True),
        (r"x\Z", "x\n", False),
        (r"(?a)\w", "é", False),
        (r"\w", "é", True),
        (r"\d", "٣", True),  # (Arabic-Indic three: a Unicode decimal)
        (r"(?i)straße", "STRASSE", False),
        (r"(?i)[a-z]+", "ABC", True),
        (r"(?s:.)", "\n", True),
        (r"(?x) a b  # comment", "ab", True),
    ],
)
def test_flags_categories_and_anchors_are_re_s(pattern: str, text: str, found: bool) -> None:
    assert (re.search(pattern, text) is not None) == found
    assert Regex(pattern).search(text, Budget()) == found


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"^(a+)+$", "a" * 5_000 + "!"),
        (r"(a|a){20}(?!)", "a" * 100),
        (r"^(a|aa)+$", "a" * 3_000 + "b"),
        (r"(x+x+)+y", "x" * 2_000),
    ],
)
def test_catastrophic_patterns_cost_linear_work(pattern: str, text: str) -> None:
    """Patterns whose ``re`` search takes exponential time: each state is explored once,
    so the work is at most program x (len(text) + 1) steps (Rule 2), counted exactly."""
    budget = Budget()
    regex = compile_regex(pattern, budget)
    before = budget.spent
    assert not regex.search(text, budget)
    assert budget.spent - before <= len(regex.program) * (len(text) + 1)


def test_a_search_past_the_budget_raises_out_of_work() -> None:
    regex = Regex(r"(a|b|ab)*c")
    with pytest.raises(OutOfWork) as info:
        regex.search("ab" * 10_000, Budget(work=5_000))
    assert info.value.what == "work"


def test_back_references_are_bounded_by_the_budget_alone() -> None:
    """With a back-reference the run is not memoised (Rule 2): a pattern whose search
    is polynomial of high degree is stopped by the budget, never by a clock."""
    with pytest.raises(OutOfWork):
        Regex(r"^(a*)(a*)(a*)(a*)\4b").search("a" * 60, Budget(work=200_000))


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(?=a){3000000}", "its program (repeats expanded) passes 50,000 instructions"),
        ("((a{1000}){1000}){1000}", "passes 50,000 instructions"),
        ("(?:){100000000}", "passes 50,000 instructions"),
        ("a" * (MAX_PATTERN_LENGTH + 1), "characters long, more than 32,768"),
        ("(?<=a+)b", "look-behind requires fixed-width pattern"),
        ("(", "is not a regular expression: missing ), unterminated subpattern"),
        ("(" * 5_000 + ")" * 5_000, "is not a regular expression"),
    ],
)
def test_patterns_past_the_bounds_are_refused_before_matching(pattern: str, message: str) -> None:
    with pytest.raises(PatternError, match=re.escape(message)):
        Regex(pattern)


def test_the_cache_is_bounded_by_size_and_charges_the_same_when_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 4: the LRU holds at most CACHE_SIZE estimated bytes; a pattern costs the same
    work whether it was cached or not (so a refusal never depends on the cache)."""
    monkeypatch.setattr(regex_module, "_cache", type(regex_module._cache)())
    monkeypatch.setattr(regex_module, "_cache_bytes", 0)
    one = Regex("x" * 1000).size
    monkeypatch.setattr(regex_module, "CACHE_SIZE", 10 * one)
    costs = []
    for i in range(30):
        budget = Budget()
        compile_regex(f"{i:04d}" + "x" * 996, budget)
        costs.append(budget.spent)
        count, size = cache_size()
        assert size <= 10 * one and count <= 10
    budget = Budget()
    compile_regex("0029" + "x" * 996, budget)  # cached
    assert budget.spent == costs[-1]
    budget = Budget()
    compile_regex("0000" + "x" * 996, budget)  # evicted, compiled again
    assert budget.spent == costs[0]
