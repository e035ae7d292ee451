"""The engine's runs of events (stepping Rule 2): :meth:`RunLoop.run_until` handles every
event before a time as as many ``step()`` calls would, writing each started step's figures
to a step log and each completion to a list instead of returning a ``StepEvents`` each.

Rule 1: the same events are handled in the same order, leaving the same state, as
        ``step()`` one at a time would (``tests/test_engine_runs.py`` compares them to the
        bit); a worker's pure decode steps are handled as one run by the fast path
        (:meth:`FastPath.decode_run`).
Rule 2: this is a base of :class:`~inference_lab.core.engine.stepping.EventLoop` and
        reaches the loop only through the attributes and methods declared here, which
        the loop defines.
Rule 3: a lone worker's decode run crosses arrivals (decode_runs Rule 2): when a step of
        the run ends at or past its limit, :meth:`RunLoop._cross` handles the arrivals
        due by that boundary as the loop would (each was filed before the boundary would
        be; counted, and the queue read after each) and gives the run its next limit;
        it stops the run when another kind of event is due by then, at ``before``, with
        ``stop_at_arrival`` or ``stop_on_finish``, on an engine of several workers, or
        when an arrival joined the step in flight (its end moved). The calendar is read
        once per arrival (``EventCalendar.top``: the earliest live entry, then
        ``drop_top``), and an arrival without a worker hint is ``_arrive``'s steps for
        a lone worker whose boundary is filed, inline.
Rule 4: given ``record`` (and neither ``stop_on_finish``, lockstep groups nor
        hand-offs, whose completions are objects anyway), a run hands each completion
        to it as the first twelve fields of the ``Finished`` it would append
        (``Request.finished_fields``), in the same order; otherwise to ``finished``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from inference_lab.core.engine.calendar import ARRIVAL, BOUNDARY, TRANSFER, EventCalendar
from inference_lab.core.engine.dp_group import DPGroup
from inference_lab.core.engine.drafting import DraftCounts
from inference_lab.core.engine.handoff import Handoffs
from inference_lab.core.engine.outputs import Finished, StepEvents, StepInfo, StepLog
from inference_lab.core.engine.request import WAITING, Request
from inference_lab.core.engine.scheduler import Scheduler
from inference_lab.core.roofline import BatchTerms, StepCost

__all__ = ["RunLoop", "RunReport", "Started"]

#: what ``_start_step`` returns for a step it started: its price, its terms, the requests
#: preempted to make room, and with speculative decoding its drafts and its plain price
Started = tuple[StepCost, BatchTerms, int, DraftCounts | None, StepCost]


@attrs.define
class RunReport:
    """What :meth:`EventLoop.run_until` handled (Rule 2), for a caller that watches the
    waiting queue (the simulator's peak and its capacity verdict).

    Attributes:
      events: events handled (each boundary of a decode run counts one).
      arrivals: arrivals among them.
      steps: steps started.
      peak_waiting: the most requests waiting after an arrival or a step that preempted.
      waiting_at_mid: requests waiting after the last arrival at or before ``mid`` (None:
        no such arrival).
      waiting_at_end: requests waiting after the last arrival (None: no arrival).
      kv_usage: the KV usage of the last step started (None: none started).
    """

    events: int = 0
    arrivals: int = 0
    steps: int = 0
    peak_waiting: int = 0
    waiting_at_mid: int | None = None
    waiting_at_end: int | None = None
    kv_usage: float | None = None


class RunLoop:
    """The event loop's runs (Rule 1). What it uses of the loop (Rule 2):"""

    step_time_factor: float
    now: float
    workers: list[Scheduler]
    _calendar: EventCalendar
    _steps: int
    _scratch: list[tuple[int, int]]
    _ended: list[tuple[Request, float, float]]
    #: what a decode run crossing arrivals reads (``_cross``; None: it may not)
    _crossing: tuple[RunReport, float, float] | None = None
    #: where a run's completions go as their fields (Rule 4; None: as ``Finished``)
    _record: Callable[[tuple[Any, ...]], None] | None = None
    groups: list[DPGroup]
    _handoffs: Handoffs | None
    _pending: int
    _finished: int
    _frontend: float
    _requests: dict[int, Request]

    def _arrive(self, r: Request, now: float) -> None:
        raise NotImplementedError

    def _join_late(self, w: Scheduler, r: Request) -> None:
        raise NotImplementedError

    def _received(self, r: Request, now: float) -> None:
        raise NotImplementedError

    def _group_boundary(self, g: DPGroup, now: float) -> StepEvents:
        raise NotImplementedError

    def _complete(
        self, w: Scheduler, now: float, emit: list[tuple[int, int]], finished: list[Finished]
    ) -> tuple[tuple[int, int], ...]:
        raise NotImplementedError

    def _ended_request(
        self, w: Scheduler, r: Request, now: float, step: float, finished: list[Finished]
    ) -> None:
        raise NotImplementedError

    def _start_step(self, w: Scheduler, now: float) -> Started | None:
        raise NotImplementedError

    def _file_transfers(self, w: Scheduler, now: float) -> None:
        raise NotImplementedError

    def _step_info(self, w: Scheduler, now: float, started: Started) -> StepInfo:
        raise NotImplementedError

    # ------------------------------------------------------------------ runs (Rule 2)
    def run_until(
        self,
        before: float,
        log: StepLog,
        finished: list[Finished],
        *,
        mid: float = -math.inf,
        stop_at_arrival: bool = False,
        stop_on_finish: bool = False,
        record: Callable[[tuple[Any, ...]], None] | None = None,
    ) -> RunReport:
        """Handle every event earlier than ``before`` as ``step()`` would (Rule 2), each
        started step's figures written to ``log`` and each completion appended to
        ``finished`` -- or, with ``record`` (Rule 4), handed to it as the first twelve
        fields of its ``Finished`` in order. Stops before an arrival with
        ``stop_at_arrival`` (its caller decides on it), and after the first event that
        completed a request with ``stop_on_finish`` (its caller submits follow-ups).
        ``mid``: the time whose queue the report gives."""
        report = RunReport()
        self._crossing = (
            None
            if stop_at_arrival or stop_on_finish or not self._one_worker()
            else (report, before, mid)
        )
        if not (stop_on_finish or self.groups or self._handoffs is not None):
            self._record = record
        try:
            return self._run(before, log, finished, report, mid, stop_at_arrival, stop_on_finish)
        finally:
            self._record = None

    def _run(
        self,
        before: float,
        log: StepLog,
        finished: list[Finished],
        report: RunReport,
        mid: float,
        stop_at_arrival: bool,
        stop_on_finish: bool,
    ) -> RunReport:
        """:meth:`run_until`'s loop."""
        cal = self._calendar
        while True:
            t = cal.next_time()
            if t is None or t >= before:
                return report
            if stop_at_arrival and cal.heap[0][2] == ARRIVAL:
                return report
            t, kind, payload = cal.pop()
            if t > self.now:
                self.now = t
            now = self.now
            report.events += 1
            if kind == ARRIVAL:
                self._arrive(payload, now)
                self._report_arrival(report, now, mid)
                continue
            if kind == TRANSFER:
                self._received(payload, now)
                continue
            done = len(finished)
            if kind == BOUNDARY:
                self._run_boundary(payload, now, before, log, finished, report, stop_on_finish)
            else:
                ev = self._group_boundary(payload, now)
                finished.extend(ev.finished)
                if ev.step is not None:
                    log.add(ev.step)
                    self._report_step(report, ev.step.kv_usage, ev.step.preempted)
            if stop_on_finish and len(finished) > done:
                return report

    def _report_arrival(self, report: RunReport, now: float, mid: float) -> None:
        """An arrival handled during ``run_until`` at ``now``: counted, and the queue
        after it looked at (the peak, and at ``mid`` and the end of the arrivals)."""
        report.arrivals += 1
        waiting = self.num_waiting()
        if waiting > report.peak_waiting:
            report.peak_waiting = waiting
        if now <= mid:
            report.waiting_at_mid = waiting
        report.waiting_at_end = waiting

    def _one_worker(self) -> bool:
        """Whether the engine is one worker stepping alone (no lockstep group, no
        hand-offs): every arrival is its own (a decode run may cross arrivals)."""
        return len(self.workers) == 1 and not self.groups and self._handoffs is None

    def _cross(self, end: float) -> float | None:
        """A decode run's step in flight ends at ``end``, at or past its limit (Rule 3):
        handle the arrivals the calendar holds until then (in ``run_until``'s order: each
        was filed before the boundary would be) and return the time of the next event
        (or the run's end) for the run to go on to; None when it must stop there (an
        event of another kind is due by ``end``, or ``end`` is the run's end), its
        boundary then filed by the caller. An arrival without a worker hint is
        ``_arrive``'s for a lone worker whose boundary is filed, inline."""
        crossing = self._crossing
        assert crossing is not None  # (only handed to a run that may cross)
        report, before, mid = crossing
        cal = self._calendar
        top = cal.top
        w = self.workers[0]
        waiting = w.waiting
        while (event := top()) is not None:
            t = event[0]
            if t > end:
                break
            if t >= before or event[2] != ARRIVAL:
                return None
            cal.drop_top()
            r = event[3]
            if t > self.now:
                self.now = t
            now = self.now
            report.events += 1
            if r.routed_worker is None and w.scheduled:  # (_arrive, for one worker)
                self._pending -= 1
                r.worker = w.index
                r.status = WAITING
                waiting.push(r)
                if r.stamped_time < w.step_start and waiting.count == 1 and w.batch:
                    self._join_late(w, r)
            else:
                self._arrive(r, now)
            report.arrivals += 1  # (_report_arrival, for one worker)
            count = waiting.count
            if count > report.peak_waiting:
                report.peak_waiting = count
            if now <= mid:
                report.waiting_at_mid = count
            report.waiting_at_end = count
            if w.step_end != end:  # it joined the step in flight (Rule 1)
                return None
        else:
            t = None
        if end >= before:
            return None
        if end > self.now:
            self.now = end
        return before if t is None or t > before else t

    def _end_requests(
        self, w: Scheduler, ended: list[tuple[Request, float, float]], finished: list[Finished]
    ) -> None:
        """The requests a decode run ended on ``w`` (each with its time and its last step's
        duration), in order: ``_ended_request`` of each -- inline when a recorder takes
        their fields without hand-offs (Rule 4)."""
        record = self._record
        if record is None or self._handoffs is not None:
            for r, t, step in ended:
                self._ended_request(w, r, t, step, finished)
            return
        requests = self._requests
        worker = w.index
        frontend = self._frontend
        for r, t, _ in ended:
            del requests[r.id]
            record(r.finished_fields(t, worker, frontend))
        self._finished += len(ended)

    def _run_boundary(
        self,
        w: Scheduler,
        now: float,
        before: float,
        log: StepLog,
        finished: list[Finished],
        report: RunReport,
        stop_on_finish: bool,
    ) -> None:
        """``run_until``'s handling of ``w``'s boundary at ``now``: with the boundaries
        after it, as one decode run when the fast path can take them (Rule 2), else alone,
        as ``_boundary`` without its ``StepEvents``."""
        cal = self._calendar
        nxt = cal.next_time()
        limit = before if nxt is None or nxt > before else nxt
        ended = self._ended
        run = w.decode_run(
            now,
            limit,
            w.roofline.price,
            self.step_time_factor,
            log,
            ended,
            stop_after_finish=stop_on_finish or w.internal,  # (a hand-off files events)
            cross=None if self._crossing is None else self._cross,
        )
        if run is not None:
            if ended:
                self._end_requests(w, ended, finished)
                ended.clear()
            self._steps += run.started
            report.events += run.boundaries - 1
            report.steps += run.started
            if run.started:
                report.kv_usage = log.kv_usage[-1]
            if not run.partial:
                if w.step_start > self.now:  # (arrivals it crossed may be later)
                    self.now = w.step_start
                if w.new_transfers:  # (its last step admitted a reception)
                    self._file_transfers(w, w.step_start)
                cal.file_boundary(w, w.step_end, BOUNDARY)
                return
            now = self.now = run.last  # its next step is ours to start
        else:
            self._complete(w, now, self._scratch, finished)
            self._scratch.clear()
        started = self._start_step(w, now)
        if started is None:
            return
        cost, _terms, preempted, counts, _plain = started
        if counts is not None:  # a speculative step: its draft figures too
            info = self._step_info(w, now, started)
            log.add(info)
            self._report_step(report, info.kv_usage, preempted)
            return
        roof = cost.roofline if cost.roofline > 0 else 1.0
        usage = (w.total_blocks - w.pool.free) / w.total_blocks
        log.kv_usage.append(usage)
        log.flop_util.append(cost.compute / roof)
        log.bw_util.append(cost.memory / roof)
        if preempted:
            log.preempted += preempted
        self._report_step(report, usage, preempted)

    def _report_step(self, report: RunReport, kv_usage: float, preempted: int) -> None:
        """A step started during ``run_until``: counted, and the queue after a
        preemption looked at (the simulator's peak)."""
        report.steps += 1
        report.kv_usage = kv_usage
        if preempted:
            waiting = self.num_waiting()
            if waiting > report.peak_waiting:
                report.peak_waiting = waiting

    def num_waiting(self) -> int:
        """Requests waiting, over every worker."""
        workers = self.workers
        if len(workers) == 1:
            return workers[0].waiting.count
        return sum(w.waiting.count for w in workers)
