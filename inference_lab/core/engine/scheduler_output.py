"""What a worker's scheduler hands the engine at a step boundary.

Rule 1: a :class:`SchedulerOutput` is the batch one worker's scheduler chose for the step
        starting at a boundary, and what the roofline prices it from; the engine keeps its
        batch as the worker's step in flight (a late arrival may join it: engine Rule 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs

from inference_lab.core.builders import frozen_builder
from inference_lab.core.engine.request import Request
from inference_lab.core.roofline import BatchTerms

__all__ = ["Batch", "SchedulerOutput", "scheduler_output"]


class Batch(Protocol):
    """The members of a step: (request, positions per sequence), in scheduling order. A
    list, or the fast path's view of its rows (:mod:`~inference_lab.core.engine.
    fast_path`), which syncs the rows' requests when iterated."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[Request, int]]: ...

    def append(self, item: tuple[Request, int]) -> None: ...


@attrs.frozen
class SchedulerOutput:
    """The batch a worker's scheduler chose for the step starting at a boundary (Rule 2).

    Attributes:
      batch: its members (:class:`Batch`); empty when nothing could run.
      positions: per sequence of the batch, the positions it computes (a group's decode
        is ``n`` sequences); None when the fast path summed ``terms`` itself.
      contexts: per sequence, the positions computed before the step (its context).
      terms: the batch's price terms when the fast path summed them, else None.
      preempted: requests preempted to make room for it.
    """

    batch: Batch
    positions: list[int] | None
    contexts: list[int] | None
    terms: BatchTerms | None
    preempted: int


scheduler_output = frozen_builder(SchedulerOutput)
