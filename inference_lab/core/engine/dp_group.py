"""The data-parallel attention ranks of one replica, which step in lockstep.

Rule 1: with ``dp_attention`` ranks, each rank is a worker (its own scheduler, waiting
        queue and KV blocks) and a replica's ranks step in lockstep: one boundary ends the
        step of all of them and starts their next batches together, priced as one step
        (the slowest rank's part and the shared experts' part: the roofline's Rule 6).
Rule 2: a rank that was idle when its group's step started may take a late arrival into
        that step (engine Rule 2); the group's step is priced again with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_lab.core.engine.scheduler import Scheduler

__all__ = ["DPGroup"]


class DPGroup:
    """One replica's ranks (Rule 1): one boundary event for all of them, and the lockstep
    step in flight."""

    __slots__ = ("ranks", "scheduled", "boundary_seq", "busy", "step_start")

    def __init__(self, ranks: Sequence[Scheduler]) -> None:
        self.ranks = list(ranks)
        self.scheduled = False  # a boundary event for this group is in the calendar
        self.boundary_seq = -1
        self.busy = False  # a lockstep step is in flight
        self.step_start = 0.0
