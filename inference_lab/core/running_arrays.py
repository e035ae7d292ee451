"""A worker's running plain requests as numpy columns: the engine's vectorised step.

When a worker runs many plain requests (``n = 1``) with neither speculative decoding nor
prefix caching, the engine keeps their per-step state -- computed positions, output
tokens, KV blocks and the positions those blocks hold -- in the int64 columns of a
:class:`RunningArrays`, one row per entry of the worker's ``running`` list, and chooses
and completes a step with a few numpy operations over the batch instead of a Python loop
over its requests (:meth:`inference_lab.core.engine._Worker.schedule`, ``_complete``).

Rule 1: row ``i`` is ``running[i]``, always: a row is added exactly when a request is
        appended to ``running`` and rows are dropped with the same mask as the list.
Rule 2: while the columns exist they, not the request objects, hold ``computed``,
        ``output``, ``blocks`` and ``room`` of the running requests (but the decoding
        ones': their requests hold them, Rule 4); :meth:`sync`
        writes them back before anything else reads those fields, and the engine leaves the
        vectorised mode (``sync`` and drop the columns) before any path that changes them
        by the objects (preemption, abort, groups, a batch the budget or the free blocks
        cannot hold whole).
Rule 3: a vectorised step is the same step the per-request loop would choose: every
        running request is in it (it is taken only when the budget holds all their
        chunks and the free blocks all their new blocks, so neither the order nor a
        preemption can change anything), each with the same positions; the integers
        handed to the roofline are the same, so the price is the same to the last bit.
Rule 4: the decoding rows ``[0, decoding)`` are lazy: each step adds one position and one
        token to every one of them, so their requests hold ``lazy = computed - g``, ``g``
        the decode counter (one increment per completed step), and a decode step writes
        nothing (``output = computed - prompt + 1`` while decoding). Their ``n`` is 1
        and their other columns are not read: a dropped decoding row moves no column. What happens to one of them at a
        known count is filed once in a calendar keyed by the value of ``g`` at which it
        happens: it finishes (``output`` reaches ``target``), it needs a KV block
        (``computed`` reaches ``room``; filed again after each growth) and, per sliding
        window ``W``, its context saturates (``computed`` reaches ``W - 1``). The window
        sums the roofline needs (:meth:`decode_sums`) are kept up to date from these, so
        a decode step costs O(1) plus its events. Calendars hold the request objects
        (rows move when others are dropped), so a decoding row's ``blocks`` and ``room``
        are kept on its request too; a row leaving the decoding set is taken out of the
        sums and of every calendar it is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

IntArray = np.ndarray[Any, np.dtype[np.int64]]


class PlainRequest(Protocol):
    """What the columns mirror of an engine request (``engine._Request``)."""

    id: int
    prompt: int
    max_tokens: int
    target: int
    computed: int
    output: int
    blocks: int
    room: int
    lazy: int


_COLUMNS = ("ids", "prompt", "max_tokens", "target", "computed", "output", "blocks", "room", "n")


class RunningArrays:
    """The columns of a worker's running requests (Rule 1), with room to grow: the rows of
    one 2-D array, so that adding or dropping requests is one operation for all columns.

    ``n`` is each row's positions in the step in flight (set when the step is chosen).
    Views ``[:size]`` of the columns are what the engine reads and writes."""

    __slots__ = (
        "size",
        "decoding",
        "step_decoding",
        "pairs",
        "table",
        "g",
        "windows",
        "base_sum",
        "sat",
        "unsat",
        "unsat_sum",
        "sat_cal",
        "finish_cal",
        "grow_cal",
        "room_for",
        "head",
        *_COLUMNS,
    )

    def __init__(
        self,
        requests: Sequence[PlainRequest],
        room_for: Callable[[int], int],
        capacity: int = 64,
        windows: Sequence[int] = (),
    ) -> None:
        size = len(requests)
        self.size = size
        #: the most positions a number of KV blocks holds (``Roofline.room_for``)
        self.room_for = room_for
        #: ``tuple(pairs)`` while the decoding rows stay the same (None: ask)
        self.head: tuple[tuple[int, int], ...] | None = None
        #: rows ``[0, decoding)`` decode (their prefill done): a step gives each one
        #: position; ``step_decoding`` is that count for the step in flight
        self.decoding = 0
        self.step_decoding = 0
        #: Rule 4: the decode counter, and the attention window classes (0: full) whose
        #: sums :meth:`decode_sums` keeps
        self.g = 0
        self.windows = tuple(windows)
        #: sum of the decoding rows' stored (offset) ``computed``
        self.base_sum = 0
        #: per window class: decoding rows saturated (``computed >= W - 1``), the others,
        #: the sum of the others' stored ``computed``, and when each of them saturates
        self.sat = [0] * len(self.windows)
        self.unsat = [0] * len(self.windows)
        self.unsat_sum = [0] * len(self.windows)
        self.sat_cal: list[dict[int, int]] = [{} for _ in self.windows]
        #: ``g`` value -> the decoding requests that finish then; -> those whose next
        #: position needs a KV block then, each with its stored ``computed``
        self.finish_cal: dict[int, list[PlainRequest]] = {}
        self.grow_cal: dict[int, list[tuple[PlainRequest, int]]] = {}
        #: per decoding row, the (id, 1) a decode step emits: made once, reused every step
        self.pairs: list[tuple[int, int]] = []
        self._bind(np.zeros((len(_COLUMNS), max(capacity, 2 * size)), np.int64))
        if size:
            self.table[:8, :size] = [
                [r.id for r in requests],
                [r.prompt for r in requests],
                [r.max_tokens for r in requests],
                [r.target for r in requests],
                [r.computed for r in requests],
                [r.output for r in requests],
                [r.blocks for r in requests],
                [r.room for r in requests],
            ]

    def _bind(self, table: IntArray) -> None:
        """Make ``table`` the storage: each column a view of one of its rows."""
        self.table = table
        (
            self.ids,
            self.prompt,
            self.max_tokens,
            self.target,
            self.computed,
            self.output,
            self.blocks,
            self.room,
            self.n,
        ) = table

    def append(self, r: PlainRequest, n: int) -> None:
        """Add ``r``'s row (it was just appended to ``running``), ``n`` positions in the
        step being chosen."""
        i = self.size
        table = self.table
        if i == table.shape[1]:
            grown = np.zeros((len(_COLUMNS), 2 * i), np.int64)
            grown[:, :i] = table
            self._bind(grown)
            table = grown
        table[:, i] = (
            r.id,
            r.prompt,
            r.max_tokens,
            r.target,
            r.computed,
            r.output,
            r.blocks,
            r.room,
            n,
        )
        self.size = i + 1

    def sync(self, requests: Sequence[PlainRequest]) -> None:
        """Write the rows' ``computed``, ``output``, ``blocks`` and ``room`` back to their
        requests (Rule 2; a decoding row's from its ``lazy`` value and ``g``, its
        ``blocks`` and ``room`` are its request's already: Rule 4). O(rows), in Python:
        only when leaving the vectorised mode or when a reader needs the objects."""
        k = self.size
        d = self.decoding
        g = self.g
        for r in requests[:d]:
            c = r.computed = r.lazy + g
            r.output = c - r.prompt + 1  # (decoding: its prefill and out - 1 are done)
        for r, c, o, b, room in zip(
            requests[d:],
            self.computed[d:k].tolist(),
            self.output[d:k].tolist(),
            self.blocks[d:k].tolist(),
            self.room[d:k].tolist(),
            strict=True,
        ):
            r.computed = c
            r.output = o
            r.blocks = b
            r.room = room

    def sync_row(self, r: PlainRequest, i: int) -> None:
        """Write row ``i`` (not decoding) back to its request ``r``."""
        r.computed, r.output, r.blocks, r.room = self.table[4:8, i].tolist()

    def computed_now(self, requests: Sequence[PlainRequest]) -> IntArray:
        """Every row's ``computed`` (``requests``: the rows' objects)."""
        comp: IntArray = self.computed[: self.size].copy()
        g = self.g
        comp[: self.decoding] = [r.lazy + g for r in requests[: self.decoding]]
        return comp

    # ------------------------------------------------------------------ Rule 4
    def start_decoding(
        self, requests: Sequence[PlainRequest], stop: int, rows: list[list[int]] | None = None
    ) -> None:
        """Rows ``[decoding, stop)`` (``requests`` are their objects, in order) decode
        from now on: their requests hold their lazy ``computed``, ``blocks`` and
        ``room``, their ``n`` is 1, and their finish, next growth and window saturations
        are filed. ``rows``: their ``target``, ``computed``, ``output``, ``blocks`` and
        ``room`` if the caller has them (else they are read)."""
        start = self.decoding
        g = self.g
        self.head = None
        if rows is None:
            rows = self.table[3:8, start:stop].T.tolist()
        if stop - start <= 4:  # a step's few: element by element
            n = self.n
            for i in range(start, stop):
                n[i] = 1
        else:
            self.n[start:stop] = 1
        for row in rows:
            row[1] -= g
            row[2] -= g
        finish_cal = self.finish_cal
        grow_cal = self.grow_cal
        windows = self.windows
        base_sum = 0
        self.pairs += [(r.id, 1) for r in requests]
        for r, (target, c, o, b, room) in zip(requests, rows, strict=True):
            r.lazy = c
            r.blocks = b
            r.room = room
            base_sum += c
            key = target - o
            slot = finish_cal.get(key)
            if slot is None:
                finish_cal[key] = [r]
            else:
                slot.append(r)
            key = room - c
            if key < g:  # ``room`` short of what its blocks hold (0: never asked)
                room = r.room = self.room_for(b)
                key = room - c
                if key < g:
                    key = g
            entry = (r, c)
            grow = grow_cal.get(key)
            if grow is None:
                grow_cal[key] = [entry]
            else:
                grow.append(entry)
            for j, window in enumerate(windows):
                if window <= 0:
                    continue
                if c + g >= window - 1:
                    self.sat[j] += 1
                else:
                    self.unsat[j] += 1
                    self.unsat_sum[j] += c
                    cal = self.sat_cal[j]
                    key = window - 1 - c
                    cal[key] = cal.get(key, 0) + 1
        self.base_sum += base_sum
        self.decoding = stop

    def finish_decoding(self, r: PlainRequest, i: int) -> None:
        """Row ``i`` (request ``r``), decoding, emitted its last token and is about to be
        dropped: write its ``computed`` and ``output`` (its target) back, take it out of
        the sums and of the calendars it is in (its finish has been taken already)."""
        c = r.lazy
        r.computed = c + self.g
        r.output = r.target
        self.base_sum -= c
        self.head = None
        key = r.room - c
        grow = self.grow_cal[key]
        if len(grow) == 1:
            del self.grow_cal[key]
        else:
            grow.remove((r, c))
        g = self.g
        for j, window in enumerate(self.windows):
            if window <= 0:
                continue
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
        for j, cal in enumerate(self.sat_cal):
            if cal:
                count = cal.pop(g, 0)
                if count:
                    self.sat[j] += count
                    self.unsat[j] -= count
                    self.unsat_sum[j] -= count * (self.windows[j] - 1 - g)
        return self.finish_cal.pop(g, None)

    def decode_sums(self) -> list[int]:
        """Per window class, the sum over the decoding rows of ``min(computed, W - 1)``
        (``computed`` for full attention): what the roofline's decode terms need."""
        g = self.g
        full = self.base_sum + self.decoding * g
        sat, unsat, unsat_sum = self.sat, self.unsat, self.unsat_sum
        return [
            full if window <= 0 else sat[j] * (window - 1) + unsat_sum[j] + unsat[j] * g
            for j, window in enumerate(self.windows)
        ]

    def drop(self, rows: list[int]) -> None:
        """Drop the rows ``rows`` (ascending indices below ``size``; a decoding one taken
        out of the calendars already), keeping the order of the others: each later row
        moves up (a slice copy per dropped row; a step drops few). The decoding rows'
        columns are not moved: only their ``n`` (all 1) is read (Rule 4)."""
        table = self.table
        k = self.size
        d = self.decoding
        pairs = self.pairs
        for i in reversed(rows):
            if i < d:  # the decoding rows' columns are not read (their n stays 1)
                if k > d:
                    table[:, d - 1 : k - 1] = table[:, d:k]
                d -= 1
                del pairs[i]
            else:
                table[:, i : k - 1] = table[:, i + 1 : k]
            k -= 1
        self.size = k
        self.decoding = d
