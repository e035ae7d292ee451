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
        ``output``, ``blocks`` and ``room`` of the running requests; :meth:`sync` writes
        them back before anything else reads those fields, and the engine leaves the
        vectorised mode (``sync`` and drop the columns) before any path that changes them
        by the objects (preemption, abort, groups, a batch the budget or the free blocks
        cannot hold whole).
Rule 3: a vectorised step is the same step the per-request loop would choose: every
        running request is in it (it is taken only when the budget holds all their
        chunks and the free blocks all their new blocks, so neither the order nor a
        preemption can change anything), each with the same positions; the integers
        handed to the roofline are the same, so the price is the same to the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
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


_COLUMNS = ("ids", "prompt", "max_tokens", "target", "computed", "output", "blocks", "room", "n")


class RunningArrays:
    """The columns of a worker's running requests (Rule 1), with room to grow: the rows of
    one 2-D array, so that adding or dropping requests is one operation for all columns.

    ``n`` is each row's positions in the step in flight (set when the step is chosen).
    Views ``[:size]`` of the columns are what the engine reads and writes."""

    __slots__ = ("size", "decoding", "step_decoding", "pairs", "table", *_COLUMNS)

    def __init__(self, requests: Sequence[PlainRequest], capacity: int = 64) -> None:
        size = len(requests)
        self.size = size
        #: rows ``[0, decoding)`` decode (their prefill done): a step gives each one
        #: position; ``step_decoding`` is that count for the step in flight
        self.decoding = 0
        self.step_decoding = 0
        #: per row, the (id, 1) a decode step emits: made once, reused every step
        self.pairs: list[tuple[int, int]] = [(r.id, 1) for r in requests]
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
        self.pairs.append((r.id, 1))
        self.size = i + 1

    def sync(self, requests: Sequence[PlainRequest]) -> None:
        """Write the rows' ``computed``, ``output``, ``blocks`` and ``room`` back to their
        requests (Rule 2). O(rows), in Python: only when leaving the vectorised mode or
        when a reader needs the objects."""
        k = self.size
        for r, c, o, b, room in zip(
            requests,
            self.computed[:k].tolist(),
            self.output[:k].tolist(),
            self.blocks[:k].tolist(),
            self.room[:k].tolist(),
            strict=True,
        ):
            r.computed = c
            r.output = o
            r.blocks = b
            r.room = room

    def sync_row(self, r: PlainRequest, i: int) -> None:
        """Write row ``i`` back to its request ``r``."""
        r.computed, r.output, r.blocks, r.room = self.table[4:8, i].tolist()

    def drop(self, rows: list[int]) -> None:
        """Drop the rows ``rows`` (ascending indices below ``size``), keeping the order of
        the others: each later row moves up (one slice copy per dropped row; a step
        drops few)."""
        table = self.table
        k = self.size
        pairs = self.pairs
        for i in reversed(rows):
            table[:, i : k - 1] = table[:, i + 1 : k]
            del pairs[i]
            k -= 1
        self.size = k
