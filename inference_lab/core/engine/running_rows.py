"""A worker's running plain requests under load: the rows of the scheduler's fast path.

When a worker runs many plain requests (``n = 1``) with neither speculative decoding nor
prefix caching, most of them decode: each step gives every one of them one position and
one token. A :class:`RunningRows` keeps those **decoding rows** lazily -- a decode
counter instead of a write per row, and calendars of the counts at which one finishes,
needs a KV block or saturates a sliding window -- so that choosing and completing a step
costs O(1) plus the step's events and its few other rows (admissions, prefill chunks),
instead of a Python loop over the batch (:mod:`~inference_lab.core.engine.fast_path`).

Rule 1: row ``i`` is ``running[i]``, always: a row is added exactly when a request is
        appended to ``running`` and rows are dropped as the list's entries are; the rows
        ``[0, decoding)`` decode, the others (``rest``) do not yet.
Rule 2: a rest row's request holds its state (``num_computed``, ``num_output``,
        ``num_blocks``, ``block_room``), as outside the fast path; its positions in the
        step in flight are in ``rest_n``. A decoding row's ``num_computed`` and
        ``num_output`` are lazy (Rule 3): :meth:`sync` writes them before anything else
        reads those fields, and the scheduler leaves the fast path (``sync`` and drop the
        rows) before any path that changes them by the objects (preemption, abort, groups,
        a batch the budget or the free blocks cannot hold whole).
Rule 3: each step adds one position and one token to every decoding row, so its request
        holds ``lazy_base = num_computed - g``, ``g`` the decode counter (one increment per
        completed step), and a decode step writes nothing (``num_output = num_computed -
        prompt + 1`` while decoding). What happens to a decoding row at a known count is
        filed once in a calendar keyed by the value of ``g`` at which it happens: it
        finishes (``num_output`` reaches ``target_tokens``), it needs a KV block
        (``num_computed`` reaches ``block_room``; filed again after each growth) and, per
        sliding window ``W``, its context saturates (``num_computed`` reaches ``W - 1``).
        The window sums the roofline needs (:meth:`decode_sums`) are kept up to date from
        these, so a decode step costs O(1) plus its events. Calendars hold the request
        objects (rows move when others are dropped); a row leaving the decoding set is
        taken out of the sums and of every calendar it is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from inference_lab.core.roofline_terms import BatchTerms


class PlainRequest(Protocol):
    """What the rows keep of an engine request (``request.Request``)."""

    id: int
    prompt_tokens: int
    max_tokens: int
    target_tokens: int
    num_computed: int
    num_output: int
    num_blocks: int
    block_room: int
    lazy_base: int


class RunningRows:
    """The rows of a worker's running requests (Rule 1): the decoding ones' counter,
    calendars and sums (Rule 3), the others' positions in the step in flight."""

    __slots__ = (
        "size",
        "decoding",
        "step_decoding",
        "rest_n",
        "pairs",
        "g",
        "windows",
        "windowed",
        "base_sum",
        "sat",
        "unsat",
        "unsat_sum",
        "sat_cal",
        "finish_cal",
        "grow_cal",
        "room_for",
        "flat",
        "two",
        "head",
    )

    def __init__(
        self,
        requests: Sequence[PlainRequest],
        room_for: Callable[[int], int],
        windows: Sequence[int] = (),
        flat: tuple[int, int, int] = (1 << 62, 0, 1),
    ) -> None:
        self.size = len(requests)
        #: rows ``[0, decoding)`` decode (their prefill done): a step gives each one
        #: position; ``step_decoding`` is that count for the step in flight
        self.decoding = 0
        self.step_decoding = 0
        #: per rest row, its positions in the step in flight (set when it is chosen)
        self.rest_n: list[int] = [0] * self.size
        #: per decoding row, the (id, 1) a decode step emits: made once, reused every step
        self.pairs: list[tuple[int, int]] = []
        #: ``tuple(pairs)`` while the decoding rows stay the same (None: ask)
        self.head: tuple[tuple[int, int], ...] | None = None
        #: the most positions a number of KV blocks holds (``Roofline.room_for``)
        self.room_for = room_for
        #: ``(p0, tail, block_size)``: ``room_for(b) = (b - tail) * block_size`` whenever
        #: that is at least ``p0`` (``Roofline.flat_blocks``; the default: never)
        self.flat = flat
        #: Rule 3: the decode counter, and the attention window classes (0: full) whose
        #: sums :meth:`decode_sums` keeps
        self.g = 0
        self.windows = tuple(windows)
        #: the sliding window classes: (index, window) each
        self.windowed = tuple((j, w) for j, w in enumerate(self.windows) if w > 0)
        #: the window of the second class when there are two, full attention and one
        #: sliding window (gpt-oss: :meth:`terms_with_one` unrolled); 0 otherwise
        self.two = self.windows[1] if len(self.windows) == 2 and self.windows[0] <= 0 else 0
        #: sum of the decoding rows' ``lazy_base``
        self.base_sum = 0
        #: per window class: decoding rows saturated (``computed >= W - 1``), the others,
        #: the sum of the others' ``lazy_base``, and how many of them saturate at each ``g``
        self.sat = [0] * len(self.windows)
        self.unsat = [0] * len(self.windows)
        self.unsat_sum = [0] * len(self.windows)
        self.sat_cal: list[dict[int, int]] = [{} for _ in self.windows]
        #: ``g`` value -> the decoding requests that finish then; -> those whose next
        #: position needs a KV block then, each with its ``lazy_base``
        self.finish_cal: dict[int, list[PlainRequest]] = {}
        self.grow_cal: dict[int, list[tuple[PlainRequest, int]]] = {}

    def append(self, n: int) -> None:
        """A row for the request just appended to ``running``, ``n`` positions in the
        step being chosen."""
        self.rest_n.append(n)
        self.size += 1

    def ns(self) -> list[int]:
        """Every row's positions in the step in flight, in row order."""
        return [1] * self.decoding + self.rest_n

    def sync(self, requests: Sequence[PlainRequest]) -> None:
        """Write the decoding rows' ``computed`` and ``output`` to their requests
        (``requests``: the rows' objects; Rule 2). O(rows): only when leaving the
        vectorised mode or when a reader needs the objects."""
        g = self.g
        for r in requests[: self.decoding]:
            c = r.num_computed = r.lazy_base + g
            r.num_output = c - r.prompt_tokens + 1

    def computed_now(self, requests: Sequence[PlainRequest]) -> list[int]:
        """Every row's ``computed`` (``requests``: the rows' objects)."""
        g = self.g
        d = self.decoding
        return [r.lazy_base + g for r in requests[:d]] + [r.num_computed for r in requests[d:]]

    # ------------------------------------------------------------------ Rule 3
    def start_decoding(self, requests: Sequence[PlainRequest]) -> None:
        """The first rest rows (``requests``, in order) decode from now on: their
        requests take the lazy form, and their finish, next growth and window
        saturations are filed."""
        g = self.g
        self.head = None
        del self.rest_n[: len(requests)]
        pairs = self.pairs
        finish_cal = self.finish_cal
        grow_cal = self.grow_cal
        windowed = self.windowed
        base_sum = 0
        for r in requests:
            pairs.append((r.id, 1))
            c = r.lazy_base = r.num_computed - g
            base_sum += c
            key = r.target_tokens - (r.num_output - g)
            slot = finish_cal.get(key)
            if slot is None:
                finish_cal[key] = [r]
            else:
                slot.append(r)
            key = r.block_room - c
            if key < g:  # ``block_room`` short of what its blocks hold (0: never asked)
                r.block_room = self.room_for(r.num_blocks)
                key = r.block_room - c
                if key < g:
                    key = g
            entry = (r, c)
            grow = grow_cal.get(key)
            if grow is None:
                grow_cal[key] = [entry]
            else:
                grow.append(entry)
            for j, window in windowed:
                if c + g >= window - 1:
                    self.sat[j] += 1
                else:
                    self.unsat[j] += 1
                    self.unsat_sum[j] += c
                    cal = self.sat_cal[j]
                    key = window - 1 - c
                    cal[key] = cal.get(key, 0) + 1
        self.base_sum += base_sum
        self.decoding += len(requests)

    def start_one(self, r: PlainRequest) -> None:
        """:meth:`start_decoding` for the first rest row alone (the end of an admission
        step): the same fields, calendars and sums, ``room_for`` past the private blocks'
        table inline (``flat``)."""
        g = self.g
        self.head = None
        del self.rest_n[0]
        self.pairs.append((r.id, 1))
        c = r.lazy_base = r.num_computed - g
        self.base_sum += c
        key = r.target_tokens - (r.num_output - g)
        slot = self.finish_cal.get(key)
        if slot is None:
            self.finish_cal[key] = [r]
        else:
            slot.append(r)
        key = r.block_room - c
        if key < g:  # ``block_room`` short of what its blocks hold (0: never asked)
            p0, tail, bs = self.flat
            room = (r.num_blocks - tail) * bs
            r.block_room = room if room >= p0 else self.room_for(r.num_blocks)
            key = r.block_room - c
            if key < g:
                key = g
        entry = (r, c)
        grow = self.grow_cal.get(key)
        if grow is None:
            self.grow_cal[key] = [entry]
        else:
            grow.append(entry)
        for j, window in self.windowed:
            if c + g >= window - 1:
                self.sat[j] += 1
            else:
                self.unsat[j] += 1
                self.unsat_sum[j] += c
                cal = self.sat_cal[j]
                key = window - 1 - c
                cal[key] = cal.get(key, 0) + 1
        self.decoding += 1

    def finish_decoding(self, r: PlainRequest) -> None:
        """The decoding request ``r`` emitted its last token and its row is about to be
        dropped: write its ``computed`` and ``output`` (its target) back, take it out of
        the sums and of the calendars it is in (its finish has been taken already)."""
        c = r.lazy_base
        r.num_computed = c + self.g
        r.num_output = r.target_tokens
        self.base_sum -= c
        self.head = None
        key = r.block_room - c
        grow = self.grow_cal[key]
        if len(grow) == 1:
            del self.grow_cal[key]
        else:
            grow.remove((r, c))
        g = self.g
        for j, window in self.windowed:
            if c + g >= window - 1:
                self.sat[j] -= 1
            else:
                self.unsat[j] -= 1
                self.unsat_sum[j] -= c
                cal = self.sat_cal[j]
                key = window - 1 - c
                left = cal[key] - 1
                if left:
                    cal[key] = left
                else:
                    del cal[key]

    def advance(self) -> list[PlainRequest] | None:
        """A step ended: every decoding row gained a position and a token (``g`` moves on);
        the windows' newly saturated rows move over, and the requests whose last token
        that was are returned (None: none)."""
        g = self.g + 1
        self.g = g
        for j, window in self.windowed:  # (a full-attention class never saturates)
            cal = self.sat_cal[j]
            if cal:
                count = cal.pop(g, 0)
                if count:
                    self.sat[j] += count
                    self.unsat[j] -= count
                    self.unsat_sum[j] -= count * (window - 1 - g)
        return self.finish_cal.pop(g, None)

    def decode_totals(self) -> list[list[int]]:
        """The window sums of a step of the decoding rows alone (``BatchTerms.sums``): per
        class, ``sum(min(computed + 1, W))`` twice (``n`` is 1: ``n * att = att``),
        i.e. :meth:`decode_sums` plus the row count."""
        g = self.g
        k = self.decoding
        out = []
        for window, sat, unsat, unsat_sum in zip(
            self.windows, self.sat, self.unsat, self.unsat_sum, strict=True
        ):
            if window <= 0:
                t = self.base_sum + k * g + k
            else:
                t = sat * (window - 1) + unsat_sum + unsat * g + k
            out.append([t, t])
        return out

    def decode_step_sums(self) -> list[int]:
        """Per window class, ``sum(min(num_computed + 1, W))`` over the decoding rows: the
        one sum a step of the decoding rows alone needs per class (its ``n . att`` and its
        ``att`` are equal), as in :meth:`decode_totals`."""
        g = self.g
        k = self.decoding
        out = []
        for window, sat, unsat, unsat_sum in zip(
            self.windows, self.sat, self.unsat, self.unsat_sum, strict=True
        ):
            if window <= 0:
                out.append(self.base_sum + k * g + k)
            else:
                out.append(sat * (window - 1) + unsat_sum + unsat * g + k)
        return out

    def terms_with(self, ns: Sequence[int], cs: Sequence[int]) -> BatchTerms:
        """The price terms of a step of the decoding rows followed by the sequences
        ``ns`` / ``cs`` (positions, context; at least one): the integers
        ``Roofline.decode_terms_of`` sums from :meth:`decode_sums` (without MLA classes),
        summed here in one pass (integers: in any order the same)."""
        g = self.g
        k = self.decoding
        rest = [(n, c + (n + 1) // 2) for n, c in zip(ns, cs, strict=True)]  # (n, midpoint)
        sat, unsat, unsat_sum = self.sat, self.unsat, self.unsat_sum
        out = []
        for j, window in enumerate(self.windows):
            if window <= 0:
                dot = total = self.base_sum + k * g + k
                for n, m in rest:
                    dot += n * m
                    total += m
            else:
                dot = total = sat[j] * (window - 1) + unsat_sum[j] + unsat[j] * g + k
                for n, m in rest:
                    att = m if m < window else window
                    dot += n * att
                    total += att
            out.append([dot, total])
        return BatchTerms(k + sum(ns), k + len(ns), out, [])

    def terms_with_one(self, n: int, c: int) -> BatchTerms:
        """:meth:`terms_with` for one sequence after the decoding rows (``n`` positions,
        context ``c``): the same integers."""
        g = self.g
        k = self.decoding
        m = c + (n + 1) // 2
        sat, unsat, unsat_sum = self.sat, self.unsat, self.unsat_sum
        w = self.two
        if w:  # (full attention and one sliding window: the loop below, unrolled)
            full = self.base_sum + k * g + k
            base = sat[1] * (w - 1) + unsat_sum[1] + unsat[1] * g + k
            att = m if m < w else w
            return BatchTerms(
                k + n, k + 1, [[full + n * m, full + m], [base + n * att, base + att]], []
            )
        out = []
        for j, window in enumerate(self.windows):
            if window <= 0:
                base = self.base_sum + k * g + k
                att = m
            else:
                base = sat[j] * (window - 1) + unsat_sum[j] + unsat[j] * g + k
                att = m if m < window else window
            out.append([base + n * att, base + att])
        return BatchTerms(k + n, k + 1, out, [])

    def decode_sums(self) -> list[int]:
        """Per window class, the sum over the decoding rows of ``min(computed, W - 1)``
        (``computed`` for full attention): what the roofline's decode terms need."""
        g = self.g
        out = []
        for window, sat, unsat, unsat_sum in zip(
            self.windows, self.sat, self.unsat, self.unsat_sum, strict=True
        ):
            if window <= 0:
                out.append(self.base_sum + self.decoding * g)
            else:
                out.append(sat * (window - 1) + unsat_sum + unsat * g)
        return out

    def drop(self, rows: list[int]) -> None:
        """Drop the rows ``rows`` (ascending indices below ``size``; a decoding one taken
        out of the calendars already), keeping the order of the others."""
        d = self.decoding
        for i in reversed(rows):
            if i < d:
                del self.pairs[i]
                self.decoding -= 1
            else:
                del self.rest_n[i - d]
        self.size -= len(rows)
