"""Characters of a client's regular expression (:mod:`inference_lab.generate.regex`): a
literal, a ``[...]`` class or a ``\\d \\s \\w`` category as a test of one character,
as ``re`` reads them for ``str`` patterns (Unicode unless ``(?a)``; case folding through
``str.lower`` / ``str.upper`` under ``(?i)``)."""

from __future__ import annotations

from collections.abc import Callable
from re import _constants as sre_c  # type: ignore[attr-defined]
from typing import Any

__all__ = [
    "ASCII_FLAG",
    "DOTALL",
    "IGNORECASE",
    "MULTILINE",
    "CharSet",
    "PatternError",
    "category_test",
    "same_char",
    "word_test",
]

#: ``re``'s flag bits, as its parser reports them.
IGNORECASE, MULTILINE, DOTALL, ASCII_FLAG = 2, 8, 16, 256


class PatternError(ValueError):
    """The pattern does not compile, is past a bound of the regex module's Rule 3, or no
    string matching it could be generated."""


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _ascii_word(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch == "_")


_CATEGORY: dict[Any, tuple[Callable[[str], bool], Callable[[str], bool]]] = {
    # category: (unicode test, ASCII test)
    sre_c.CATEGORY_DIGIT: (str.isdecimal, lambda c: "0" <= c <= "9"),
    sre_c.CATEGORY_SPACE: (str.isspace, lambda c: c in " \t\n\r\f\v"),
    sre_c.CATEGORY_WORD: (_word, _ascii_word),
    sre_c.CATEGORY_LINEBREAK: (lambda c: c == "\n", lambda c: c == "\n"),
}
_NEGATED = {
    sre_c.CATEGORY_NOT_DIGIT: sre_c.CATEGORY_DIGIT,
    sre_c.CATEGORY_NOT_SPACE: sre_c.CATEGORY_SPACE,
    sre_c.CATEGORY_NOT_WORD: sre_c.CATEGORY_WORD,
    sre_c.CATEGORY_NOT_LINEBREAK: sre_c.CATEGORY_LINEBREAK,
}


def category_test(category: Any, ascii_only: bool) -> Callable[[str], bool]:
    """The test of ``\\d \\s \\w`` (and their negations) as ``re`` reads them."""
    if category in _NEGATED:
        test = category_test(_NEGATED[category], ascii_only)
        return lambda c: not test(c)
    unicode, ascii_ = _CATEGORY[category]
    return ascii_ if ascii_only else unicode


class CharSet:
    """A ``[...]`` class (or ``\\d``-style category) as a test of one character; answers
    are cached per character (at most 4,096)."""

    __slots__ = ("chars", "ranges", "tests", "negate", "fold", "_seen")

    def __init__(self, items: list[tuple[Any, Any]], flags: int) -> None:
        self.chars: set[str] = set()
        self.ranges: list[tuple[int, int]] = []
        self.tests: list[Callable[[str], bool]] = []
        self.negate = False
        self.fold = bool(flags & IGNORECASE)
        self._seen: dict[str, bool] = {}
        for op, arg in items:
            if op is sre_c.NEGATE:
                self.negate = True
            elif op is sre_c.LITERAL:
                self.chars.add(chr(arg))
            elif op is sre_c.RANGE:
                self.ranges.append(arg)
            elif op is sre_c.CATEGORY:
                self.tests.append(category_test(arg, bool(flags & ASCII_FLAG)))
            else:
                raise PatternError(f"unsupported class item {op}")

    def _plain(self, ch: str) -> bool:
        if ch in self.chars:
            return True
        o = ord(ch)
        return any(lo <= o <= hi for lo, hi in self.ranges) or any(t(ch) for t in self.tests)

    def __call__(self, ch: str) -> bool:
        hit = self._seen.get(ch)
        if hit is None:
            hit = self._plain(ch)
            if not hit and self.fold:
                hit = any(len(v) == 1 and self._plain(v) for v in (ch.lower(), ch.upper()))
            hit = hit != self.negate
            if len(self._seen) < 4096:
                self._seen[ch] = hit
        return hit


def same_char(flags: int, code: int) -> Callable[[str], bool] | str:
    """A literal: the character itself, or (ignoring case) a test."""
    ch = chr(code)
    if not flags & IGNORECASE or ch.lower() == ch.upper():
        return ch
    lower, upper = ch.lower(), ch.upper()
    return lambda c: c == ch or c.lower() == lower or c.upper() == upper


def word_test(ch: str, ascii_only: bool) -> bool:
    """Whether ``ch`` is a word character for ``\\b`` (ASCII only under ``(?a)``)."""
    return _ascii_word(ch) if ascii_only else _word(ch)
