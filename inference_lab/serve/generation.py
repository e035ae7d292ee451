"""Planning an agent answer off the event loop: schemas, patterns and instances are
generated within a work budget, on the event loop while cheap, in a worker thread once
not (:mod:`inference_lab.generate.budget`).

Rule 1: a plan is first attempted on the event loop with
        :data:`~inference_lab.generate.budget.INLINE_WORK` units: what ``/health`` and every
        stream may wait behind one request is that many units of work, whatever the
        request (a tool call's small schema is answered there, with no thread). A body
        larger than :data:`INLINE_BODY` is planned in the thread at once: reading its
        agent fields and hashing it for its seed are linear in it.
Rule 2: a plan that needs more starts again, from the same seed, in a worker thread
        (:func:`trio.to_thread.run_sync`, at most :data:`THREADS` at once per run) with
        the whole budget, so its answer is the one the event loop would have given; a
        refusal past the whole budget is the same 400 either way.
Rule 3: a planning task that is cancelled (shutdown) abandons its thread and cancels its
        budget: the thread stops at its next spend, within a few thousand units.
Rule 4: the thread lets go of the GIL every ``PAUSE_UNITS`` units (``time.sleep(0)``), so
        the event loop never waits for it longer than that.
Rule 5: an error out of a plan (a 400) continues without the plan's tracebacks, so
        nothing of the request outlives it in a reference cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from inference_lab.api.agents import AnswerPlan
from inference_lab.generate.budget import INLINE_WORK, Budget, OutOfWork

__all__ = ["INLINE_BODY", "THREADS", "plan_off_loop"]

#: Bodies up to this many bytes are planned on the event loop first (Rule 1).
INLINE_BODY = 64 * 1024
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


def _forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the errors it was raised from or during
    (Rule 5): trio's outcome keeps the error in a frame of the thread's traceback, and a
    worker frame keeps its caller, so the chain is a reference cycle that would hold the
    request's body until the cyclic collector runs (360 MB after 100 refused 1.5 MB
    patterns). The 400 it becomes needs no traceback."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _let_go() -> None:
    time.sleep(0)  # (releases the GIL: a waiting event loop takes it at once)


async def plan_off_loop(
    plan: Callable[[Budget], AnswerPlan | None], *, inline: bool = True
) -> AnswerPlan | None:
    """``plan(budget)`` (which draws from a fresh generator each call) within the budget of
    Rules 1-4, first on the event loop when ``inline``; raises what ``plan`` raises (an
    ``ApiError`` 400 past the whole budget)."""
    if inline:
        try:
            return plan(Budget(inline_work=INLINE_WORK))
        except OutOfWork as exc:
            if exc.what != "inline":
                _forget_frames(exc)
                raise
        except Exception as exc:
            _forget_frames(exc)
            raise
    budget = Budget(pause=_let_go)
    try:
        return await trio.to_thread.run_sync(
            plan, budget, abandon_on_cancel=True, limiter=_limiter()
        )
    except trio.Cancelled:
        budget.cancel()
        raise
    except Exception as exc:
        _forget_frames(exc)
        raise
