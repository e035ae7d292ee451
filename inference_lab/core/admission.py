"""The admission ledger of one served model: seats, waiting places, refusals.

An arrival is refused (529) only when the engine has nowhere to put it: no free *seat* in
the running batch of the replica the router sends it to, and no free *waiting place*.

Rule 1: a request holds a seat when the scheduler will admit it as soon as a step has token
        budget for it: on its replica, the running sequences and the seats already held
        leave room for its ``n`` under ``max_num_seqs``, and the free KV blocks left by the
        seats already held take its first prefill chunk. For a speculative model the free
        blocks are those its running requests' next verify steps leave (their lookahead
        is reserved before any admission: ``Engine.queue_views``). Every other queued
        request holds a waiting place; ``max_waiting`` bounds those (0: never refuse).
Rule 2: the queue is walked in admission order -- the engine's waiting queue (as the
        scheduler orders it), then the arrivals admitted but not yet stepped into it, in
        the order they were admitted -- and once one request holds a waiting place, every
        later one on that replica does too (the scheduler never skips ahead).
Rule 3: the ledger does not depend on when the engine steps: an arrival stepped into the
        engine's queue holds the same seat or place as it did while pending, so N
        simultaneous arrivals into an idle model admit exactly
        ``min(N, max_num_seqs * replicas + max_waiting)`` when KV allows.
Rule 4: the router chooses an arrival's replica at admission (:meth:`Engine.route`, with
        the arrivals already routed and not yet stepped counted), and the request carries
        that choice into the engine, so the ledger and the engine agree on it.
Rule 5: the ledger is rebuilt from the engine only when the engine changed (its owner
        calls :meth:`Admission.changed` after a step, an abort or a new cap; a claim's
        release marks it too); each admission and each refusal between two changes costs
        O(1). With ``max_waiting`` 0 no seat is ever needed to decide and nothing is
        walked.
Rule 6: :meth:`Admission.refuses` decides as :meth:`Admission.admit` would, and changes
        nothing (the router's choice is only looked at): a caller may ask it before it has
        a request to admit.
"""

from __future__ import annotations

import attrs

from inference_lab.core.engine import Engine, QueueView, RequestSpec

__all__ = ["Admission", "Claim"]


@attrs.define(eq=False)
class Claim:
    """What one admitted arrival holds while it is not yet in the engine's queue."""

    worker: int
    n: int
    blocks: int
    seated: bool = False


@attrs.define
class _Room:
    """One replica's part of the ledger, walked in admission order (Rules 1 and 2)."""

    #: Sequences under the cap not taken by running sequences or seats held.
    seqs: int
    #: Free blocks not taken by the first chunks of seats held.
    blocks: int
    #: Whether nothing queued so far holds a waiting place.
    open: bool = True
    #: Queued requests holding waiting places.
    places: int = 0
    #: Whether no sequence runs and no seat is held (then any group is admitted alone,
    #: however wide: scheduler Rule 2).
    empty: bool = False

    @classmethod
    def of(cls, view: QueueView) -> _Room:
        room = cls(
            seqs=max(0, view.max_num_seqs - view.running_seqs),
            blocks=view.free_blocks,
            empty=view.running_seqs == 0,
        )
        for n, blocks in view.queued:
            room.take(n, blocks)
        return room

    def admits(self, n: int, blocks: int) -> bool:
        return self.open and blocks <= self.blocks and (n <= self.seqs or self.empty)

    def take(self, n: int, blocks: int) -> bool:
        """Walk one queued request: True when it holds a seat."""
        if self.admits(n, blocks):
            self.seqs = max(0, self.seqs - n)
            self.blocks -= blocks
            self.empty = False
            return True
        self.open = False
        self.places += 1
        return False


class Admission:
    """Seats and waiting places of one model (see the module rules). Owned by the model's
    runtime; every method is synchronous and free of checkpoints."""

    def __init__(self, engine: Engine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        #: Arrivals admitted and not yet in the engine's queue, in admission order.
        self._pending: dict[object, Claim] = {}
        self._routed = [0] * len(engine.workers)
        self._rooms: list[_Room] = []
        self._stale = True

    # -- changes -------------------------------------------------------------------------
    def changed(self) -> None:
        """The engine's queues, batch, blocks or cap changed: rebuild before the next
        decision."""
        self._stale = True

    def set_max_waiting(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting

    def release(self, key: object) -> Claim | None:
        """``key``'s arrival entered the engine's queue, was aborted or failed: it is no
        longer pending (the engine's queue now accounts for it, if it is there)."""
        claim = self._pending.pop(key, None)
        if claim is not None:
            self._routed[claim.worker] -= 1
            self._stale = True
        return claim

    def clear(self) -> None:
        """The engine stopped: nothing is pending any more."""
        self._pending.clear()
        self._routed = [0] * len(self._routed)
        self._stale = True

    # -- reading -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Arrivals admitted and not yet in the engine's queue."""
        return len(self._pending)

    def _rebuild(self) -> None:
        rooms = [_Room.of(view) for view in self.engine.queue_views()]
        for claim in self._pending.values():
            claim.seated = rooms[claim.worker].take(claim.n, claim.blocks)
        self._rooms = rooms
        self._stale = False

    def depth(self) -> int:
        """Queued requests holding waiting places (what ``max_waiting`` bounds)."""
        if self._stale:
            self._rebuild()
        return sum(room.places for room in self._rooms)

    def at_bound(self) -> bool:
        """Whether the waiting places are all taken (``max_waiting`` > 0), so that an arrival
        without a seat would be refused: the cheap first look before :meth:`refuses`."""
        return bool(self.max_waiting) and self.depth() >= self.max_waiting

    # -- deciding ------------------------------------------------------------------------
    def refuses(self, spec: RequestSpec) -> bool:
        """Whether :meth:`admit` would refuse ``spec`` now; nothing changes (Rule 6)."""
        if not self.at_bound():
            return False
        engine = self.engine
        worker = engine.route(spec, self._routed, advance=False)
        return not self._rooms[worker].admits(spec.n, engine.first_chunk_blocks(spec, worker))

    def admit(self, key: object, spec: RequestSpec) -> Claim | None:
        """Route an arrival and give it a seat or a waiting place; None when it has
        neither (refuse it). ``key`` identifies it for :meth:`release`."""
        engine = self.engine
        n = spec.n
        if not self.max_waiting:
            worker = engine.route(spec, self._routed)
            claim = Claim(worker, n, engine.first_chunk_blocks(spec, worker))
        else:
            if self._stale:
                self._rebuild()
            worker = engine.route(spec, self._routed, advance=False)
            claim = Claim(worker, n, engine.first_chunk_blocks(spec, worker))
            room = self._rooms[worker]
            if not room.admits(n, claim.blocks) and self.depth() >= self.max_waiting:
                return None
            engine.route(spec, self._routed)  # the same choice, now taken
            claim.seated = room.take(n, claim.blocks)
        self._pending[key] = claim
        self._routed[claim.worker] += 1
        if not self.max_waiting:
            self._stale = True
        return claim
