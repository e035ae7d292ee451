"""The scalar values of generated JSON Schema instances: numbers within bounds and
``multipleOf``, ``format`` strings, placeholder words (:mod:`inference_lab.generate.instances`
builds the instances; every draw comes from the caller's generator).

Rule 1: a number returned lies within every bound of the conjunction and is a multiple of
        every ``multipleOf`` as validators compute it (floating point); when none can be
        found the schema is :class:`~inference_lab.generate.validator.Unsatisfiable` at its
        path.
Rule 2: strings are printable ASCII placeholder text.
"""

from __future__ import annotations

import math
import random
import uuid
from fractions import Fraction
from typing import Any

import attrs

from inference_lab.generate.validator import (
    Unsatisfiable,
    _is_multiple,
    _lower_bounds,
    _positive_number,
    _upper_bounds,
)
from inference_lab.generate.vocabulary import VOCABULARY

__all__ = ["formatted", "lcm", "number", "words"]


def number(conj: list[dict[str, Any]], path: str, integer: bool, rng: random.Random) -> int | float:
    """A number (an integer when ``integer``) within every bound and ``multipleOf`` of
    ``conj``; Unsatisfiable naming ``path`` when none exists."""
    lower = [b for s in conj for b in _lower_bounds(s, path)]
    upper = [b for s in conj for b in _upper_bounds(s, path)]
    steps = [_positive_number(s, "multipleOf", path) for s in conj if "multipleOf" in s]
    lo, lo_ex = max(lower, key=lambda b: (b[0], b[1])) if lower else (None, False)
    hi, hi_ex = min(upper, key=lambda b: (b[0], not b[1])) if upper else (None, False)
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
        raise Unsatisfiable(path, f"no number lies between the bounds {lo} and {hi}")
    step = Fraction(1) if integer else None
    for m in steps:
        frac = Fraction(str(m))
        step = frac if step is None else lcm(step, frac)
    if step is not None:
        return _multiple(step, lo, lo_ex, hi, hi_ex, steps, integer, path, rng)
    low = lo if lo is not None else (hi - 100 if hi is not None else 0)
    high = hi if hi is not None else low + 100
    for _ in range(8):
        value = round(rng.uniform(float(low), float(high)), 2)
        if lo is not None and (value < lo or (lo_ex and value == lo)):
            value = (float(low) + float(high)) / 2
        if hi is not None and (value > hi or (hi_ex and value == hi)):
            value = (float(low) + float(high)) / 2
        if (lo is None or value > lo or (not lo_ex and value == lo)) and (
            hi is None or value < hi or (not hi_ex and value == hi)
        ):
            return value
    raise Unsatisfiable(path, f"no number found between the bounds {lo} and {hi}")


def _multiple(
    step: Fraction,
    lo: Any,
    lo_ex: bool,
    hi: Any,
    hi_ex: bool,
    steps: list[Any],
    integer: bool,
    path: str,
    rng: random.Random,
) -> int | float:
    """A multiple of ``step`` within the bounds that every ``multipleOf`` accepts as
    validators compute it (floating point)."""
    k_lo: int | None = None
    if lo is not None:
        ratio = Fraction(lo) / step
        k_lo = math.floor(ratio) + 1 if (lo_ex and ratio.denominator == 1) else math.ceil(ratio)
    k_hi: int | None = None
    if hi is not None:
        ratio = Fraction(hi) / step
        k_hi = math.ceil(ratio) - 1 if (hi_ex and ratio.denominator == 1) else math.floor(ratio)
    if k_lo is None and k_hi is None:
        k_lo = 0
        k_hi = max(1, math.floor(100 / step))
    elif k_lo is None:
        assert k_hi is not None
        k_lo = k_hi - max(1, math.floor(100 / step))
    elif k_hi is None:
        k_hi = k_lo + max(1, math.floor(100 / step))
    if k_lo > k_hi:
        raise Unsatisfiable(path, f"no multiple of {step} lies between the bounds")
    tried: set[int] = set()
    for _ in range(24):
        k = rng.randint(k_lo, k_hi)
        if k in tried:
            continue
        tried.add(k)
        exact = k * step
        value: int | float = int(exact) if exact.denominator == 1 else float(exact)
        if integer and not isinstance(value, int):
            continue
        if all(_is_multiple(value, m) for m in steps):
            return value
        if len(tried) > k_hi - k_lo:
            break
    raise Unsatisfiable(path, f"no multiple of {step} found that validates in floating point")


def words(lo: int, hi: int | None, rng: random.Random) -> str:
    """Placeholder words, ``lo`` to ``hi`` characters (a few words without ``hi``)."""
    if hi is not None and hi < 40:
        target = rng.randint(lo, max(lo, hi))
    else:
        target = max(lo, len(" ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 5)))))
        if hi is not None:
            target = min(target, hi)
    words: list[str] = []
    size = -1
    while size < target:
        word = rng.choice(VOCABULARY)
        words.append(word)
        size += len(word) + 1
    text = " ".join(words)[:target]
    return text if not text.endswith(" ") else text[:-1] + "s"


def lcm(a: Fraction, b: Fraction) -> Fraction:
    """The least common multiple of two positive rationals."""
    num = a.numerator * b.numerator // math.gcd(a.numerator, b.numerator)
    return Fraction(num, math.gcd(a.denominator, b.denominator))


def formatted(fmt: str, rng: random.Random) -> str | None:
    """A string of the ``format`` (None for a format without a generator here)."""
    year, month, day = rng.randint(2000, 2030), rng.randint(1, 12), rng.randint(1, 28)
    hour, minute, second = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    word = rng.choice(VOCABULARY)
    other = rng.choice(VOCABULARY)
    if fmt in _DATED:
        when = _When(year, month, day, hour, minute, second)
        return _dated(fmt, when, rng)
    return _named(fmt, word, other, rng)


#: the formats of a date, a time or a duration (``_dated``)
_DATED = ("date-time", "date", "time", "duration")


@attrs.frozen
class _When:
    """The date and time ``formatted`` drew (every format draws them, in one order)."""

    year: int
    month: int
    day: int
    hour: int
    minute: int
    second: int


def _dated(fmt: str, w: _When, rng: random.Random) -> str:
    """A date, time, date-time or duration string (``formatted``)."""
    if fmt == "date-time":
        return f"{w.year:04d}-{w.month:02d}-{w.day:02d}T{w.hour:02d}:{w.minute:02d}:{w.second:02d}Z"
    if fmt == "date":
        return f"{w.year:04d}-{w.month:02d}-{w.day:02d}"
    if fmt == "time":
        return f"{w.hour:02d}:{w.minute:02d}:{w.second:02d}Z"
    return f"P{rng.randint(1, 30)}DT{rng.randint(1, 23)}H"


def _named(fmt: str, word: str, other: str, rng: random.Random) -> str | None:
    """An address, identifier or pattern string from two drawn words (``formatted``);
    None for a format without a generator here."""
    if fmt in ("email", "idn-email"):
        return f"{word}.{other}@example.com"
    if fmt in ("hostname", "idn-hostname"):
        return f"{word}-{other}.example.com"
    if fmt == "ipv4":
        return f"192.0.2.{rng.randint(1, 254)}"
    if fmt == "ipv6":
        return f"2001:db8::{rng.randint(1, 0xFFFF):x}"
    if fmt in ("uri", "url", "iri", "uri-reference", "iri-reference"):
        return f"https://example.com/{word}/{other}"
    if fmt == "uri-template":
        return f"https://example.com/{{{word}}}"
    if fmt == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if fmt == "json-pointer":
        return f"/{word}/{other}"
    if fmt == "relative-json-pointer":
        return f"0/{word}"
    if fmt == "regex":
        return f"^{word}$"
    return None
