"""What watches a simulation as it runs: observers of the engine's events.

The loop (:func:`inference_lab.sim.run.run_simulation`) tells every observer, in order,
about each event once it has recorded it (its step figures and completions, and the
follow-ups submitted): :meth:`RunObserver.on_step` with the event, or
:meth:`RunObserver.on_run` with the report of events the engine handled as one run
(``Engine.run_until``). Before it steps an event at or after an observer's
:attr:`~RunObserver.due` time, it calls that observer's :meth:`~RunObserver.before_step`.

Rule 1: an observer does constant work per event (the time series adds a finished
        request's latencies), so the engine's own cost dominates the loop.
Rule 2: arrivals are taken in runs only when every observer takes runs
        (:attr:`~RunObserver.takes_runs`): one that must see each arrival (the
        ``max_waiting`` bound, the time series, an ``on_events`` callback) turns runs off.
Rule 3: the ``max_waiting`` bound comes first: the queue lengths the others read are
        those after its refusals.
Rule 4: pure but for the engine they read: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from inference_lab.core.admission import Admission
from inference_lab.core.engine import Engine, Finished, RunReport, StepEvents
from inference_lab.sim.capacity import CapacityVerdict, assess_capacity
from inference_lab.sim.intake import Intake
from inference_lab.sim.records import QUEUE_LIMIT, StepTotals

__all__ = [
    "PROGRESS_EVERY",
    "Progress",
    "ProgressMeter",
    "QueueWatch",
    "RunObserver",
    "WaitingBound",
]

#: Progress is reported every this many engine events (and once at the end).
PROGRESS_EVERY = 256


class RunObserver:
    """The interface the loop drives (module docstring); the defaults do nothing."""

    __slots__ = ()

    #: whether events may reach it as the report of a run (:meth:`on_run`) rather than
    #: one event each (Rule 2)
    takes_runs = True
    #: the time at or after which the loop calls :meth:`before_step` (inf: never)
    due = math.inf

    def before_step(self, time: float) -> None:
        """The loop is about to step an event at ``time`` >= :attr:`due`."""

    def on_run(self, report: RunReport) -> None:
        """The engine handled a run of events (``Engine.run_until``) and the loop
        recorded their steps and completions."""

    def on_step(self, ev: StepEvents) -> None:
        """The engine returned ``ev`` and the loop recorded it."""


class QueueWatch(RunObserver):
    """The waiting queue: its peak (after an arrival or a preemption), and for an open
    loop its length right after the last arrival at or before the middle of the arrival
    window and right after the last arrival, for the capacity verdict
    (:mod:`inference_lab.sim.capacity`)."""

    __slots__ = ("_engine", "_num_waiting", "mid_arrival", "peak", "at_mid", "at_end")

    def __init__(self, engine: Engine, arrival_times: npt.NDArray[np.float64], closed: bool):
        self._engine = engine
        self._num_waiting = engine.num_waiting
        #: the middle of the arrival window (-inf: no verdict to prepare)
        self.mid_arrival = (
            (float(arrival_times.min()) + float(arrival_times.max())) / 2
            if len(arrival_times) and not closed
            else -math.inf
        )
        self.peak = self._num_waiting()
        self.at_mid = 0
        self.at_end = 0

    def on_run(self, report: RunReport) -> None:
        if report.waiting_at_mid is not None:
            self.at_mid = report.waiting_at_mid
        if report.waiting_at_end is not None:
            self.at_end = report.waiting_at_end
        if report.peak_waiting > self.peak:
            self.peak = report.peak_waiting

    def on_step(self, ev: StepEvents) -> None:
        if ev.arrived:
            waiting = self._num_waiting()
            if ev.time <= self.mid_arrival:
                self.at_mid = waiting
            self.at_end = waiting
        elif ev.step is not None and ev.step.preempted:
            waiting = self._num_waiting()
        else:
            return
        if waiting > self.peak:
            self.peak = waiting

    def verdict(
        self, offered: npt.NDArray[np.float64], finish_times: npt.NDArray[np.float64],
        rejected: Sequence[float],
    ) -> CapacityVerdict | None:  # fmt: skip
        """The capacity verdict of an open loop whose arrivals (refused by ``max_waiting``
        included) were ``offered``."""
        return assess_capacity(
            offered,
            finish_times,
            rejected=rejected,
            waiting_at_mid=self.at_mid,
            waiting_at_end=self.at_end,
        )


class WaitingBound(RunObserver):
    """``max_waiting`` as serve's admission applies it (``inference_lab.core.admission``):
    an arrival that has no seat in its replica's batch and finds ``bound`` waiting places
    taken is refused when the engine handles it (limit ``max_waiting``, serve's 529) and
    aborted before any step sees it; its user is parked (:meth:`Intake.park`) and
    ``on_refused`` (the time series' count) is told."""

    takes_runs = False
    __slots__ = ("_engine", "_bound", "_ledger", "_intake", "_on_refused", "rejected_at")

    def __init__(
        self,
        engine: Engine,
        bound: int,
        intake: Intake,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._bound = bound
        self._ledger = Admission(engine, bound)  # seats and waiting places, as serve admits
        self._intake = intake
        self._on_refused = on_refused
        #: the arrival times refused, in order
        self.rejected_at: list[float] = []

    def on_step(self, ev: StepEvents) -> None:
        if not ev.arrived:
            return
        ledger = self._ledger
        ledger.changed()
        places = ledger.depth()
        if places > self._bound:  # no seat, and it found `bound` places taken
            rid = ev.arrived[0]
            self._engine.abort(rid)
            arrival = self._intake.arrivals.pop(rid)
            self.rejected_at.append(arrival.time)
            reason = f"{places - 1} waiting (max_waiting = {self._bound})"
            self._intake.refuse(arrival, QUEUE_LIMIT, reason)
            if self._on_refused is not None:
                self._on_refused()
            self._intake.park(arrival)


@attrs.frozen(kw_only=True)
class Progress:
    """A sample of the run for a progress display (taken every PROGRESS_EVERY events)."""

    time: float  # simulated seconds
    done: int  # completed requests
    refused: int
    total: int | None  # requests the workload will issue, when known
    running: int
    waiting: int
    kv_usage: float  # of the last step that started, in [0, 1]


class ProgressMeter(RunObserver):
    """Calls ``report`` with a :class:`Progress` every :data:`PROGRESS_EVERY` events (a run
    may overshoot it) and once more at :meth:`finish`; the KV usage
    is the last step's (``steps``)."""

    __slots__ = ("_report", "_engine", "_finished", "_refused", "_steps", "_total", "_left")

    def __init__(
        self,
        report: Callable[[Progress], None],
        engine: Engine,
        records: tuple[StepTotals, Sequence[Finished]],
        intake: Intake,
        total: int | None,
    ) -> None:
        self._report = report
        self._engine = engine
        self._steps, self._finished = records
        self._refused = intake.refused
        self._total = total
        #: events until the next report (a run may overshoot it)
        self._left = PROGRESS_EVERY

    def on_run(self, report: RunReport) -> None:
        self._left -= report.events
        if self._left <= 0:
            self._left += PROGRESS_EVERY
            self.finish()

    def on_step(self, ev: StepEvents) -> None:
        self._left -= 1
        if self._left <= 0:
            self._left += PROGRESS_EVERY
            self.finish()

    def finish(self) -> None:
        """Report where the run is now."""
        engine = self._engine
        kv_usage = self._steps.kv_usage
        self._report(
            Progress(
                time=engine.now,
                done=len(self._finished),
                refused=len(self._refused),
                total=self._total,
                running=engine.num_running(),
                waiting=engine.num_waiting(),
                kv_usage=kv_usage[-1] if kv_usage else 0.0,
            )
        )
