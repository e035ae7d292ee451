"""The work budget of one request's generated content (schemas, patterns, instances).

Generating a tool call's arguments or a structured output runs code whose cost the
client chooses: a pattern to match, an ``enum`` to scan, a schema to expand. Every loop
of that code spends from one :class:`Budget` per request, so the cost is bounded by
numbers, not by a clock.

Rule 1: deterministic: a budget counts work units (a regex step, a value tried, a
        schema expanded, an enum entry hashed) and output bytes, never time, so the same
        request is refused, or answered, the same way on any machine and under any load.
Rule 2: spending past the budget raises :class:`OutOfWork` (``what`` says which
        budget); the code that knows where in the schema it was sets ``path`` on the way
        out (the innermost frame wins), so the 400 names the expensive place.
Rule 3: a budget may be cancelled from another thread (:meth:`Budget.cancel`): the next
        spend raises :class:`OutOfWork` with ``what == "cancelled"``, so a worker thread
        whose request was abandoned stops within a few thousand units.
Rule 4: a budget spent in a worker thread calls its ``pause`` every :data:`PAUSE_UNITS`
        units (the serve layer passes ``time.sleep(0)``: the thread lets go of the GIL,
        so the event loop waits for it at most that many units, not the interpreter's
        5 ms switch interval).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "BYTES_PER_UNIT",
    "PAUSE_UNITS",
    "INLINE_WORK",
    "MAX_OUTPUT_BYTES",
    "MAX_WORK",
    "Budget",
    "OutOfWork",
]

#: Work units one request's generated content may take in all (tools and structured
#: output together). A unit is about a microsecond of CPU (a regex step, a third of a
#: schema checked, a quarter of a value tried, 16 bytes of output): a second or two in a
#: worker thread at most.
MAX_WORK = 1_000_000
#: Work units a request may take on the event loop before its generation moves to a
#: worker thread (about 2 ms: what ``/health`` may wait behind one request).
INLINE_WORK = 1_000
#: Output bytes that cost one work unit (encoding them, cutting them into tokens).
BYTES_PER_UNIT = 16
#: Work units between two calls of a budget's ``pause`` (Rule 4).
PAUSE_UNITS = 200
#: Bytes of generated JSON one request's documents may hold (before ``n``).
MAX_OUTPUT_BYTES = 1 << 20


class OutOfWork(Exception):
    """A budget ran out (Rule 2). ``what`` is ``"work"``, ``"bytes"``, ``"inline"`` (the
    event loop's share: not an error, the caller moves to a thread) or ``"cancelled"``;
    ``path`` is the schema place being worked on (None until a frame that knows sets
    it); ``detail`` is a short reason when the place knows one."""

    def __init__(self, what: str, detail: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.path: str | None = None
        self.detail = detail

    def at(self, path: str) -> OutOfWork:
        """Name ``path`` if no inner frame did; returns self (``raise exc.at(path)``)."""
        if self.path is None:
            self.path = path
        return self


class Budget:
    """What one request may still spend (Rules 1-3). ``work`` and ``output_bytes`` are
    the limits; ``inline`` is True while the budget runs on the event loop, where it
    stops at ``inline_work`` units with :class:`OutOfWork` ``"inline"``."""

    __slots__ = (
        "limit",
        "spent",
        "bytes_limit",
        "bytes_spent",
        "_cancelled",
        "what_limit",
        "pause",
        "_next_pause",
    )

    def __init__(
        self,
        work: int = MAX_WORK,
        output_bytes: int = MAX_OUTPUT_BYTES,
        *,
        inline_work: int | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        self.limit = work if inline_work is None else min(work, inline_work)
        self.what_limit = "work" if inline_work is None or inline_work >= work else "inline"
        self.spent = 0
        self.bytes_limit = output_bytes
        self.bytes_spent = 0
        self._cancelled = False
        self.pause = pause
        self._next_pause = PAUSE_UNITS

    @property
    def left(self) -> int:
        """Work units left before :class:`OutOfWork`."""
        return self.limit - self.spent

    def spend(self, units: int = 1) -> None:
        """Spend ``units`` of work; raises :class:`OutOfWork` past the limit or once
        cancelled."""
        self.spent += units
        if self.spent > self.limit:
            raise OutOfWork(self.what_limit)
        if self._cancelled:
            raise OutOfWork("cancelled")
        if self.pause is not None and self.spent >= self._next_pause:
            self._next_pause = self.spent + PAUSE_UNITS
            self.pause()

    def spend_bytes(self, count: int) -> None:
        """Count ``count`` bytes of output (and their work, :data:`BYTES_PER_UNIT`);
        raises :class:`OutOfWork` ``"bytes"`` past the limit (call it before building the
        text, so nothing larger is built)."""
        self.bytes_spent += count
        if self.bytes_spent > self.bytes_limit:
            raise OutOfWork("bytes")
        self.spend(count // BYTES_PER_UNIT)

    @property
    def bytes_left(self) -> int:
        return self.bytes_limit - self.bytes_spent

    def new_document(self, limit: int) -> None:
        """Count the next document's bytes from 0, against ``limit`` (the work spent so
        far stays spent)."""
        self.bytes_limit = limit
        self.bytes_spent = 0

    def cancel(self) -> None:
        """Stop the work at its next spend (Rule 3; safe from any thread)."""
        self._cancelled = True
