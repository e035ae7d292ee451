"""Clients' regular expressions, matched in bounded work (JSON Schema ``pattern``,
``patternProperties``, vLLM's ``guided_regex``).

Python's ``re`` backtracks without a bound (``^(a+)+$`` against ``"aaaa…!"`` runs for
minutes) and caches every compiled pattern (100 distinct 1.5 MB patterns held 2.5 GB).
A client's pattern is therefore parsed with ``re``'s own parser (so the syntax, and what
it means, is Python's) and compiled here into a small program that a backtracking
matcher runs with memoisation: each (instruction, position) state is explored at most
once, so a search costs at most ``program × (len(text) + 1)`` steps, and every step is
spent from the request's :class:`~inference_lab.generate.budget.Budget`.

Rule 1: ``Regex.search(text)`` agrees with ``re.search(pattern, text) is not None``
        (``tests/test_regex.py`` compares them on generated patterns and texts),
        look-arounds, atomic groups, possessive repeats, back-references and
        conditionals included; case folding is ``str.lower`` / ``str.upper``.
Rule 2: without back-references or conditionals a state is (instruction, position) and
        the work is polynomial as above; with them a state also holds the groups'
        positions, and the work is bounded by the budget alone.
Rule 3: a pattern longer than :data:`MAX_PATTERN_LENGTH` characters, or whose program
        (repeats expanded) passes :data:`MAX_PROGRAM` instructions, is a
        :class:`PatternError` naming the bound, before any matching.
Rule 4: compiled patterns are kept in one LRU (:func:`compile_regex`) bounded by
        :data:`CACHE_SIZE` estimated bytes, never by ``re``'s unbounded cache; the
        cost spent on a pattern is the same whether it was cached or not (Rule 1 of the
        budget).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from re import _constants as sre_c  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from inference_lab.generate.budget import Budget
from inference_lab.generate.regex_chars import (
    ASCII_FLAG,
    DOTALL,
    IGNORECASE,
    MULTILINE,
    CharSet,
    PatternError,
    same_char,
    word_test,
)

__all__ = [
    "CACHE_SIZE",
    "MAX_PATTERN_LENGTH",
    "MAX_PROGRAM",
    "PatternError",
    "Regex",
    "cache_size",
    "compile_regex",
    "parse_units",
]

#: Longest pattern parsed (Rule 3): far above any hand-written or generated schema's.
MAX_PATTERN_LENGTH = 32_768
#: Most instructions of one compiled pattern (Rule 3).
MAX_PROGRAM = 50_000
#: Estimated bytes of compiled patterns kept (Rule 4).
CACHE_SIZE = 64 * 1024 * 1024
#: Estimated bytes per program instruction and per pattern character (parse tree),
#: measured by ``scripts/stress/hostile.py``'s pattern case.
_INSTRUCTION_BYTES = 160
_PATTERN_BYTES = 200


# opcodes
(CHAR, NOT_CHAR, ANY, SET, SPLIT, JMP, AT, LOOK, ATOMIC, SAVE, BACKREF, COND, MATCH, CHECK) = range(
    14
)
(_BEGIN, _BEGIN_LINE, _END, _END_LINE, _BEGIN_STRING, _END_STRING, _BOUND, _NOT_BOUND) = range(8)
_AT = {
    sre_c.AT_BEGINNING: _BEGIN,
    sre_c.AT_BEGINNING_STRING: _BEGIN_STRING,
    sre_c.AT_END: _END,
    sre_c.AT_END_STRING: _END_STRING,
    sre_c.AT_BOUNDARY: _BOUND,
    sre_c.AT_NON_BOUNDARY: _NOT_BOUND,
}
#: the constructs that stand for one character (``char``)
_CHAR_OPS = (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN, sre_c.CATEGORY)
_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT)


# ---------------------------------------------------------------------------------------
# compiling


class _Compiler:
    """Emits the program of a parsed pattern (each instruction ``(op, a, b)``)."""

    def __init__(self, captures: bool, groups: int, budget: Budget) -> None:
        self.program: list[tuple[int, Any, Any]] = []
        self.captures = captures
        self.budget = budget
        self.units = 0
        #: the next slot of the state's positions: 2 per group, then one per loop
        self.slots = 2 * groups + 2

    def emit(self, op: int, a: Any = None, b: Any = None) -> int:
        self.program.append((op, a, b))
        self._grow()
        return len(self.program) - 1

    def _grow(self) -> None:
        self.units += 1
        self.budget.spend()  # (a unit per instruction: what a cached pattern is charged)
        if self.units > MAX_PROGRAM:
            raise PatternError(
                f"its program (repeats expanded) passes {MAX_PROGRAM:,} instructions"
            )

    def patch(self, at: int, a: Any = None, b: Any = None) -> None:
        op, old_a, old_b = self.program[at]
        self.program[at] = (op, old_a if a is None else a, old_b if b is None else b)

    def seq(self, items: Any, flags: int) -> None:
        for op, arg in items:
            self.node(op, arg, flags)

    def node(self, op: Any, arg: Any, flags: int) -> None:
        """Emit one parsed construct: a character (``char``) or a structure (one case
        each)."""
        if op in _CHAR_OPS:
            self.char(op, arg, flags)
        elif op is sre_c.BRANCH:
            self.branch(arg[1], flags)
        elif op is sre_c.SUBPATTERN:
            self.group(arg, flags)
        elif op in _REPEATS:
            lo, hi, items = arg
            if op is sre_c.POSSESSIVE_REPEAT:
                self.atomic([(sre_c.MAX_REPEAT, arg)], flags)
            else:
                self.repeat(lo, hi, items, flags, greedy=op is sre_c.MAX_REPEAT)
        elif op is sre_c.ATOMIC_GROUP:
            self.atomic(arg, flags)
        elif op is sre_c.AT:
            self.at(arg, flags)
        elif op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            self.look(arg[0], arg[1], flags, negate=op is sre_c.ASSERT_NOT)
        elif op is sre_c.GROUPREF:
            self.emit(BACKREF, arg, bool(flags & IGNORECASE))
        elif op is sre_c.GROUPREF_EXISTS:
            self.conditional(arg, flags)
        else:
            raise PatternError(f"unsupported regular expression construct {op}")

    def char(self, op: Any, arg: Any, flags: int) -> None:
        """One character: a literal, a negated literal, ``.``, a class or a category."""
        if op is sre_c.LITERAL:
            self.emit(CHAR, same_char(flags, arg))
        elif op is sre_c.NOT_LITERAL:
            self.emit(NOT_CHAR, same_char(flags, arg))
        elif op is sre_c.ANY:
            self.emit(ANY, bool(flags & DOTALL))
        elif op is sre_c.IN:
            self.emit(SET, CharSet(arg, flags))
        else:  # a category
            self.emit(SET, CharSet([(sre_c.CATEGORY, arg)], flags))

    def group(self, arg: Any, flags: int) -> None:
        """A group, with its inline flags; saving its bounds when it captures."""
        group, add, remove, items = arg
        inner = (flags | add) & ~remove
        if self.captures and group is not None:
            self.emit(SAVE, 2 * group)
            self.seq(items, inner)
            self.emit(SAVE, 2 * group + 1)
        else:
            self.seq(items, inner)

    def conditional(self, arg: Any, flags: int) -> None:
        """``(?(group)yes|no)``: a test of the group, then either branch."""
        group, yes, no = arg
        test = self.emit(COND, group)
        self.seq(yes, flags)
        skip = self.emit(JMP)
        self.patch(test, b=len(self.program))
        if no is not None:
            self.seq(no, flags)
        self.patch(skip, a=len(self.program))

    def branch(self, alternatives: list[Any], flags: int) -> None:
        jumps = []
        for i, alternative in enumerate(alternatives):
            split = self.emit(SPLIT) if i < len(alternatives) - 1 else None
            if split is not None:
                self.patch(split, a=split + 1)
            self.seq(alternative, flags)
            if split is not None:
                jumps.append(self.emit(JMP))
                self.patch(split, b=len(self.program))
        for jump in jumps:
            self.patch(jump, a=len(self.program))

    def repeat(self, lo: int, hi: int, items: Any, flags: int, *, greedy: bool) -> None:
        for _ in range(lo):
            self._grow()  # (an empty body emits nothing: count its copies anyway)
            self.seq(items, flags)
        if hi is sre_c.MAXREPEAT:
            if self.captures:  # ``re``'s rule: an empty iteration is the last one
                mark = self.slots
                self.slots += 1
                loop = self.emit(SPLIT)
                self.emit(SAVE, mark)
                self.seq(items, flags)
                check = self.emit(CHECK, mark)
            else:  # (memoised states end empty iterations by themselves)
                loop = self.emit(SPLIT)
                self.seq(items, flags)
            self.emit(JMP, loop)
            end = len(self.program)
            self.patch(loop, *((loop + 1, end) if greedy else (end, loop + 1)))
            if self.captures:
                self.patch(check, b=end)
            return
        splits = []
        for _ in range(hi - lo):
            splits.append(self.emit(SPLIT))
            self.seq(items, flags)
        end = len(self.program)
        for split in splits:
            self.patch(split, *((split + 1, end) if greedy else (end, split + 1)))

    def sub(self, items: Any, flags: int) -> int:
        """A sub-program (look-around or atomic body) placed inline, jumped over; its
        start."""
        jump = self.emit(JMP)
        start = len(self.program)
        self.seq(items, flags)
        self.emit(MATCH)
        self.patch(jump, a=len(self.program))
        return start

    def atomic(self, items: Any, flags: int) -> None:
        at = self.emit(ATOMIC)
        self.patch(at, a=self.sub(items, flags))

    def look(self, direction: int, items: Any, flags: int, *, negate: bool) -> None:
        width = 0
        if direction < 0:
            lo, hi = items.getwidth()  # (a SubPattern of the parse)
            if lo != hi:
                raise PatternError("look-behind requires fixed-width pattern")
            width = lo
        at = self.emit(LOOK)
        self.patch(at, a=self.sub(items, flags), b=(direction < 0, negate, width))

    def at(self, code: Any, flags: int) -> None:
        kind = _AT.get(code)
        if kind is None:
            raise PatternError(f"unsupported anchor {code}")
        if flags & MULTILINE:
            kind = {_BEGIN: _BEGIN_LINE, _END: _END_LINE}.get(kind, kind)
        self.emit(AT, kind, bool(flags & ASCII_FLAG))


def _uses_groups(items: Any) -> bool:
    """Whether a back-reference or a conditional appears anywhere (Rule 2)."""
    for op, arg in items:
        if op in (sre_c.GROUPREF, sre_c.GROUPREF_EXISTS):
            return True
        for sub in _children(op, arg):
            if _uses_groups(sub):
                return True
    return False


def _children(op: Any, arg: Any) -> list[Any]:
    if op is sre_c.BRANCH:
        return list(arg[1])
    if op is sre_c.SUBPATTERN:
        return [arg[3]]
    if op in _REPEATS:
        return [arg[2]]
    if op is sre_c.ATOMIC_GROUP:
        return [arg]
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
        return [arg[1]]
    return []


class Regex:
    """A compiled client pattern: ``search`` in bounded work (Rules 1-2); ``parsed`` is
    ``re``'s parse, for the string generator."""

    __slots__ = (
        "pattern",
        "parsed",
        "flags",
        "program",
        "captures",
        "groups",
        "slots",
        "size",
        "units",
    )

    def __init__(self, pattern: str, budget: Budget | None = None) -> None:
        """Parse and compile ``pattern``, spending :func:`parse_units` and a unit per
        instruction (``units``) from ``budget`` (default: a whole request's)."""
        spend = Budget() if budget is None else budget
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise PatternError(
                f"the pattern is {len(pattern):,} characters long, more than {MAX_PATTERN_LENGTH:,}"
            )
        spend.spend(parse_units(pattern))
        try:
            parsed = sre_parse.parse(pattern)
        except (sre_c.error, RecursionError, OverflowError) as exc:
            raise PatternError(
                f"pattern {shown(pattern)} is not a regular expression: {exc}"
            ) from None
        self.pattern = pattern
        self.parsed = parsed
        self.flags: int = parsed.state.flags
        if self.flags & 4:  # re.LOCALE: refused by re for str patterns already
            raise PatternError("the LOCALE flag is not supported")
        self.groups: int = parsed.state.groups
        try:
            self.captures = _uses_groups(parsed)
            compiler = _Compiler(self.captures, self.groups, spend)
            # an unanchored search: try here, else step one character and try again
            compiler.emit(SPLIT, 3, 1)
            compiler.emit(ANY, True)
            compiler.emit(JMP, 0)
            compiler.seq(parsed, self.flags)
            compiler.emit(MATCH)
        except RecursionError:
            raise PatternError(f"pattern {shown(pattern)} nests too deep") from None
        self.program = compiler.program
        self.units = compiler.units
        self.slots = compiler.slots
        self.size = _INSTRUCTION_BYTES * len(self.program) + _PATTERN_BYTES * len(pattern)

    def search(self, text: str, budget: Budget) -> bool:
        """Whether ``text`` holds a match (``re.search``); spends a unit per state
        explored (Rule 2), raising :class:`~inference_lab.generate.budget.OutOfWork`."""
        return _Matcher(self, text, budget).run(0, 0, ()) is not None


def shown(pattern: str) -> str:
    """``pattern`` for an error message: its repr, cut to 60 characters."""
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


# ---------------------------------------------------------------------------------------
# matching

_Caps = tuple[int, ...]
#: States kept in a bit array (1 MB) when the whole space fits, else in a set.
_BITMAP_STATES = 1 << 23


class _Matcher:
    """One search: the depth-first run of Rule 2, memoised unless the pattern refers to
    its groups (then a state's groups matter, and only the budget bounds the run)."""

    def __init__(self, regex: Regex, text: str, budget: Budget) -> None:
        self.regex = regex
        self.text = text
        self.budget = budget
        self.stride = len(text) + 1
        self.subs: dict[Any, tuple[int, _Caps] | None] = {}

    # The interpreter's inner loop, every hot case inline: splitting it (the memo's test,
    # an instruction's case) would add a Python call per state explored.
    def run(  # noqa: C901, PLR0912, PLR0915
        self, pc: int, pos: int, caps: _Caps, *, top: bool = True
    ) -> tuple[int, _Caps] | None:
        """The first match from ``pc`` at ``pos`` reaching a MATCH, or None. The top run
        keeps its states in a bit array when they fit :data:`_BITMAP_STATES`; a
        sub-run (one per look-around position) in a set of integers, which costs what
        it holds."""
        program, text, n = self.regex.program, self.text, len(self.text)
        memo = not self.regex.captures
        if not memo and not caps:
            caps = (-1,) * self.regex.slots
        states = len(program) * self.stride
        bits = bytearray((states >> 3) + 1) if memo and top and states <= _BITMAP_STATES else None
        seen: set[int] = set()
        stack: list[tuple[int, int, _Caps]] = [(pc, pos, caps)]
        steps = 0
        try:
            while stack:
                pc, pos, caps = stack.pop()
                while True:
                    if bits is not None:
                        key = pc * self.stride + pos
                        if bits[key >> 3] & (1 << (key & 7)):
                            break
                        bits[key >> 3] |= 1 << (key & 7)
                    elif memo:
                        key = pc * self.stride + pos
                        if key in seen:
                            break
                        seen.add(key)
                    steps += 1
                    if steps >= 256:
                        spent, steps = steps, 0
                        self.budget.spend(spent)
                    op, a, b = program[pc]
                    if op == CHAR or op == NOT_CHAR:
                        if pos >= n:
                            break
                        ch = text[pos]
                        hit = ch == a if type(a) is str else a(ch)
                        if hit != (op == CHAR):
                            break
                        pc += 1
                        pos += 1
                    elif op == SET:
                        if pos >= n or not a(text[pos]):
                            break
                        pc += 1
                        pos += 1
                    elif op == ANY:
                        if pos >= n or (not a and text[pos] == "\n"):
                            break
                        pc += 1
                        pos += 1
                    elif op == SPLIT:
                        stack.append((b, pos, caps))
                        pc = a
                    elif op == JMP:
                        pc = a
                    elif op == MATCH:
                        return pos, caps
                    else:  # the rarer ones
                        if op == LOOK or op == ATOMIC:
                            spent, steps = steps, 0
                            self.budget.spend(spent)
                        moved = self._other(op, a, b, pc, pos, caps)
                        if moved is None:
                            break
                        pc, pos, caps = moved
        finally:
            if steps:
                self.budget.spent += steps  # (the last few: counted, never raising here)
        return None

    def _other(
        self, op: int, a: Any, b: Any, pc: int, pos: int, caps: _Caps
    ) -> tuple[int, int, _Caps] | None:
        """The state after an anchor, a group's bound, a back-reference, a conditional,
        a loop's check, a look-around or an atomic group at ``pos``; None when it fails."""
        text = self.text
        if op == AT:
            return (pc + 1, pos, caps) if _at(a, b, text, pos) else None
        if op == SAVE:
            return pc + 1, pos, (*caps[:a], pos, *caps[a + 1 :])
        if op == BACKREF:
            end = _backref(text, pos, caps, a, b)
            return None if end is None else (pc + 1, end, caps)
        if op == COND:
            return (pc + 1 if caps[2 * a + 1] >= 0 else b), pos, caps
        if op == CHECK:
            return (b if pos == caps[a] else pc + 1), pos, caps
        found = self._sub(op, a, b, pos, caps)  # LOOK, ATOMIC
        return None if found is None else (pc + 1, *found)

    def _sub(
        self, op: int, start: int, kind: Any, pos: int, caps: _Caps
    ) -> tuple[int, _Caps] | None:
        """An ATOMIC body's first match from ``pos`` (the position after it), or a LOOK's
        verdict (``pos`` unchanged); results are memoised per (body, position[, groups])."""
        at = pos
        if op == LOOK:
            behind, negate, width = kind
            at = pos - width if behind else pos
            if at < 0:
                return (pos, caps) if negate else None
        key = (start, at, caps) if self.regex.captures else (start, at)
        if key in self.subs:
            found = self.subs[key]
        else:
            found = self.run(start, at, caps, top=False)
            self.subs[key] = found
        if op == ATOMIC:
            return found
        if negate:
            return None if found is not None else (pos, caps)
        return None if found is None else (pos, found[1])


def _at(kind: int, ascii_only: bool, text: str, pos: int) -> bool:
    n = len(text)
    if kind == _BEGIN or kind == _BEGIN_STRING:
        return pos == 0
    if kind == _BEGIN_LINE:
        return pos == 0 or text[pos - 1] == "\n"
    if kind == _END:
        return pos == n or (pos == n - 1 and text[pos] == "\n")
    if kind == _END_LINE:
        return pos == n or text[pos] == "\n"
    if kind == _END_STRING:
        return pos == n
    before = pos > 0 and word_test(text[pos - 1], ascii_only)
    after = pos < n and word_test(text[pos], ascii_only)
    return (before != after) == (kind == _BOUND)


def _backref(text: str, pos: int, caps: _Caps, group: int, fold: bool) -> int | None:
    """Where a back-reference to ``group`` ends when it matches at ``pos``."""
    start, end = caps[2 * group], caps[2 * group + 1]
    if start < 0 or end < 0:
        return None
    want = text[start:end]
    got = text[pos : pos + len(want)]
    if len(got) < len(want):
        return None
    if got == want or (fold and got.lower() == want.lower()):
        return pos + len(want)
    return None


# ---------------------------------------------------------------------------------------
# the cache (Rule 4)

_cache: OrderedDict[str, Regex] = OrderedDict()
_cache_bytes = 0
_lock = threading.Lock()


def parse_units(pattern: str) -> int:
    """Work units of parsing ``pattern`` (``re``'s parser: up to several microseconds a
    character)."""
    return 4 * len(pattern) + 1


def compile_regex(pattern: str, budget: Budget) -> Regex:
    """``pattern`` compiled (from the cache when it is there), spending
    :func:`parse_units` and a unit per instruction from ``budget`` whether cached or not
    (Rule 4): a compilation spends as it goes, so an exhausted budget stops it. Raises
    :class:`PatternError` (Rule 3) or ``OutOfWork``."""
    global _cache_bytes
    with _lock:
        regex = _cache.get(pattern)
        if regex is not None:
            _cache.move_to_end(pattern)
    if regex is not None:
        budget.spend(parse_units(pattern) + regex.units)
    else:
        regex = Regex(pattern, budget)
        with _lock:
            if pattern not in _cache and regex.size <= CACHE_SIZE:
                _cache[pattern] = regex
                _cache_bytes += regex.size
                while _cache_bytes > CACHE_SIZE:
                    _, old = _cache.popitem(last=False)
                    _cache_bytes -= old.size
    return regex


def cache_size() -> tuple[int, int]:
    """(patterns, estimated bytes) in the cache."""
    with _lock:
        return len(_cache), _cache_bytes
