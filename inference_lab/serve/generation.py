"""Planning an agent answer off the event loop: schemas, patterns and instances are
generated within a work budget, on the event loop while cheap, in a worker thread once
not (:mod:`inference_lab.api.budget`).

Rule 1: a plan is first attempted on the event loop with
        :data:`~inference_lab.api.budget.INLINE_WORK` units: what ``/health`` and every
        stream may wait behind one request is that many units of work, whatever the
        request (a tool call's small schema is answered there, with no thread).
Rule 2: a plan that needs more starts again, from the same seed, in a worker thread
        (:func:`trio.to_thread.run_sync`, at most :data:`THREADS` at once per run) with
        the whole budget, so its answer is the one the event loop would have given; a
        refusal past the whole budget is the same 400 either way.
Rule 3: a planning task that is cancelled (shutdown) abandons its thread and cancels its
        budget: the thread stops at its next spend, within a few thousand units.
Rule 4: the thread lets go of the GIL every ``PAUSE_UNITS`` units (``time.sleep(0)``), so
        the event loop never waits for it longer than that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from inference_lab.api.agents import AnswerPlan
from inference_lab.api.budget import INLINE_WORK, Budget, OutOfWork

__all__ = ["THREADS", "plan_off_loop"]

#: Worker threads planning answers at once per run (the machine's cores are shared with
#: the event loop; more requests wait for a thread).
THREADS = 2

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("plan_limiter")


def _limiter() -> trio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(THREADS)
        _LIMITER.set(limiter)
        return limiter


def _let_go() -> None:
    time.sleep(0)  # (releases the GIL: a waiting event loop takes it at once)


async def plan_off_loop(plan: Callable[[Budget], AnswerPlan | None]) -> AnswerPlan | None:
    """``plan(budget)`` (which draws from a fresh generator each call) within the budget of
    Rules 1-3; raises what ``plan`` raises (an ``ApiError`` 400 past the whole budget)."""
    try:
        return plan(Budget(inline_work=INLINE_WORK))
    except OutOfWork as exc:
        if exc.what != "inline":
            raise
    budget = Budget(pause=_let_go)
    try:
        return await trio.to_thread.run_sync(
            plan, budget, abandon_on_cancel=True, limiter=_limiter()
        )
    except trio.Cancelled:
        budget.cancel()
        raise
