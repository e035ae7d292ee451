"""Strings that match a regular expression: JSON Schema ``pattern``, vLLM's guided regex.

A generator over Python's own parse of the pattern (``re._parser``, through
:mod:`inference_lab.generate.regex`), so the strings match what ``re.search`` accepts. Only
the simple constructs are generated: literals, classes, ``\\d \\w \\s`` and their
negations, alternation, groups, repeats, anchors and back-references. Look-arounds and
conditionals are skipped while generating and the result is checked with the bounded
matcher (:meth:`~inference_lab.generate.regex.Regex.search`), so a pattern this module cannot
serve raises :class:`PatternError` instead of yielding a string that does not match.

Rule 1: every string :func:`pattern_string` returns matches the pattern (``re.search``).
Rule 2: characters are printable ASCII (classes and negations pick from it), so a
        string survives any JSON encoding unchanged.
Rule 3: an unbounded repeat (``*``, ``+``, ``{n,}``) repeats at most 4 more times than its
        minimum; every choice comes from the caller's generator.
Rule 4: every node built and every check spends from the request's
        :class:`~inference_lab.generate.budget.Budget` (the pattern's compilation included);
        the pattern's own part of a string is at most :data:`MAX_PATTERN_STRING`
        characters (a ``min_length`` past it is met with lowercase filler, when the
        pattern is not anchored at its end).
"""

from __future__ import annotations

import random
import re
import string
from re import _constants as sre_c  # type: ignore[attr-defined]
from typing import Any

from inference_lab.generate.budget import Budget
from inference_lab.generate.regex import PatternError, Regex, compile_regex, shown

__all__ = ["PatternError", "compile_pattern", "pattern_string"]

#: The alphabet a class or a negation picks from (Rule 2).
PRINTABLE = string.ascii_letters + string.digits + " -_.,:;!?/@#()[]{}+*=&%$'\"<>|~^`\\"
_DIGITS = string.digits
_WORD = string.ascii_letters + string.digits + "_"
_SPACE = " "
_CATEGORIES: dict[Any, str] = {
    sre_c.CATEGORY_DIGIT: _DIGITS,
    sre_c.CATEGORY_WORD: _WORD,
    sre_c.CATEGORY_SPACE: " \t\n",
}
_NEGATED: dict[Any, Any] = {
    sre_c.CATEGORY_NOT_DIGIT: sre_c.CATEGORY_DIGIT,
    sre_c.CATEGORY_NOT_WORD: sre_c.CATEGORY_WORD,
    sre_c.CATEGORY_NOT_SPACE: sre_c.CATEGORY_SPACE,
}
#: Extra repeats of an unbounded repeat (Rule 3).
MAX_EXTRA_REPEATS = 4
#: Longest string built for one pattern (a guard against ``(a{1000}){1000}``).
MAX_PATTERN_STRING = 4096


class _TooLong(Exception):
    pass


def _class_chars(items: list[tuple[Any, Any]]) -> tuple[str, bool]:
    """The characters of a ``[...]`` class (restricted to :data:`PRINTABLE` plus what it
    names) and whether it is negated."""
    negate = False
    chars: set[str] = set()
    for op, arg in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            chars.add(chr(arg))
        elif op is sre_c.RANGE:
            lo, hi = arg
            if hi - lo > 512:  # a wide range: its printable ASCII part, else its start
                picked = {c for c in PRINTABLE if lo <= ord(c) <= hi}
                chars |= picked or {chr(lo)}
            else:
                chars |= {chr(c) for c in range(lo, hi + 1)}
        elif op is sre_c.CATEGORY:
            if arg in _CATEGORIES:
                chars |= set(_CATEGORIES[arg])
            elif arg in _NEGATED:
                chars |= set(PRINTABLE) - set(_CATEGORIES[_NEGATED[arg]])
    return "".join(sorted(chars)), negate


class _Builder:
    def __init__(self, rng: random.Random, flags: int, budget: Budget) -> None:
        self.rng = rng
        self.groups: dict[int, str] = {}
        self.ignore_case = bool(flags & re.IGNORECASE)
        self.size = 0
        self.budget = budget

    def emit(self, text: str) -> str:
        self.size += len(text)
        if self.size > MAX_PATTERN_STRING:
            raise _TooLong
        return text

    def seq(self, items: Any) -> str:
        return "".join(self.node(op, arg) for op, arg in items)

    def node(self, op: Any, arg: Any) -> str:
        """A string for one parsed construct: a character (``_char``) or a structure of
        others (one case each)."""
        rng = self.rng
        self.budget.spend()
        if op in _CHAR_OPS:
            return self._char(op, arg)
        if op is sre_c.BRANCH:
            return self.seq(rng.choice(arg[1]))
        if op is sre_c.SUBPATTERN:
            group, _add, _del, items = arg
            text = self.seq(items)
            if group is not None:
                self.groups[group] = text
            return text
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, items = arg
            top = lo + MAX_EXTRA_REPEATS if hi is sre_c.MAXREPEAT else min(hi, lo + 5)
            return "".join(self.seq(items) for _ in range(rng.randint(lo, top)))
        if op is getattr(sre_c, "ATOMIC_GROUP", None):
            return self.seq(arg)
        if op is sre_c.GROUPREF:
            return self.emit(self.groups.get(arg, ""))
        if op is sre_c.AT or op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            return ""  # anchors hold for a whole match; look-arounds are checked after
        if op is sre_c.GROUPREF_EXISTS:
            _group, yes, no = arg
            return self.seq(yes) if no is None or rng.random() < 0.5 else self.seq(no)
        raise PatternError(f"unsupported regular expression construct {op}")

    def _char(self, op: Any, arg: Any) -> str:
        """One character of a literal, a negated literal, ``.``, a class or a category."""
        rng = self.rng
        if op is sre_c.LITERAL:
            return self.emit(chr(arg))
        if op is sre_c.NOT_LITERAL:
            return self.emit(rng.choice([c for c in PRINTABLE if ord(c) != arg]))
        if op is sre_c.ANY:
            return self.emit(rng.choice(string.ascii_letters + string.digits))
        if op is sre_c.IN:
            self.budget.spend(len(arg))
            chars, negate = _class_chars(arg)
            if negate:
                pool = [c for c in PRINTABLE if c not in chars]
                if self.ignore_case:
                    pool = [c for c in pool if c.swapcase() not in chars]
            else:
                pool = list(chars)
            if not pool:
                raise PatternError("a character class matches no printable character")
            return self.emit(rng.choice(pool))
        # a category (only inside a class in practice)
        return self.emit(rng.choice(_CATEGORIES.get(arg, _WORD)))


#: the constructs that stand for one character (``_Builder._char``)
_CHAR_OPS = (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN, sre_c.CATEGORY)


def compile_pattern(pattern: str, budget: Budget | None = None) -> Regex:
    """``pattern`` compiled as JSON Schema's ``pattern`` is (Python's ``re`` syntax, the
    bounded matcher of :mod:`inference_lab.generate.regex`); raises :class:`PatternError`
    naming what is wrong when it does not compile or passes a bound."""
    return compile_regex(pattern, Budget() if budget is None else budget)


def pattern_string(
    pattern: str | Regex,
    rng: random.Random,
    *,
    min_length: int = 0,
    max_length: int | None = None,
    attempts: int = 16,
    budget: Budget | None = None,
) -> str:
    """A string matching ``pattern`` (``re.search``) of ``min_length`` to ``max_length``
    characters (Rule 1); raises :class:`PatternError` when none was found in
    ``attempts`` tries, or ``OutOfWork`` past ``budget`` (Rule 4). A pattern given
    compiled was spent for when it was compiled."""
    spend = Budget() if budget is None else budget
    compiled = pattern if isinstance(pattern, Regex) else compile_regex(pattern, spend)
    source = compiled.pattern
    anchored_end = source.endswith("$") and not source.endswith("\\$")
    for _ in range(attempts):
        builder = _Builder(rng, compiled.flags, spend)
        try:
            text = builder.seq(compiled.parsed)
        except _TooLong:
            continue
        if len(text) < min_length and not anchored_end:
            missing = min_length - len(text)
            spend.spend(missing // 8 + 1)  # (the caller counted the bytes before asking)
            text += "".join(rng.choices(string.ascii_lowercase, k=missing))
        if len(text) < min_length or (max_length is not None and len(text) > max_length):
            continue
        if compiled.search(text, spend):
            return text
    bounds = f" of {min_length}..{'' if max_length is None else max_length} characters"
    raise PatternError(
        f"cannot generate a string{bounds if min_length or max_length is not None else ''} "
        f"matching pattern {shown(source)}"
    )
