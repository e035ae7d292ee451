"""A loaded worker's decode runs: its step boundaries one after another without the
engine's calendar in between (the fast path's Rule 4).

Most boundaries of a worker in the fast path (:mod:`~inference_lab.core.engine.fast_path`)
end a step in which every running request decoded and start another such step; the others
admit an arrival or run a prefill chunk alongside the decoding rows. A decode run hands
the worker the boundaries up to the next calendar event it cannot take itself and starts
every step the fast path takes whole, so the engine's calendar and its per-step
bookkeeping see one event per run.

Rule 1 (the fast path's Rule 4): a decode run (``FastPath.decode_run``, whose other
        methods are here: :class:`DecodeRuns`, a base of ``FastPath``) handles the
        boundaries as the engine handles each alone (``EventLoop._boundary`` without its
        ``StepEvents``): each ends the step in flight as ``complete_fast`` does (a pure
        decode step's end only moves the decode counter on) and starts the next one as
        ``EventLoop._start_step`` would: a pure decode step from the window sums (the
        roofline's decode pricer; a stretch of them in one loop,
        :func:`~inference_lab.core.engine.stretch.decode_stretch`), any other by the fast
        path's whole step (``_schedule_whole``: admissions, prefill chunks), priced by
        the engine's price -- the same steps with the same figures, to the bit. A boundary
        whose next step the fast path does not take (blocks short, a group, too few rows)
        ends the run with its step in flight ended and the next one left to the caller.
Rule 2: when a step of the run ends at or past its limit (the next calendar event), the
        run sets the step in flight's fields and asks its caller (``cross``) to handle the
        events due by then: a lone worker's arrivals only, each filed before the boundary
        would be, so taking them first is the calendar's order. The caller answers with
        the next event's time and the run goes on to it, or stops it there (another kind
        of event is due, the run's end) and files its boundary.
Rule 3: a pure decode step in flight leaves its price terms to be worked out when read
        (:meth:`DecodeRuns.terms_in_flight`: a late arrival joining it, or leaving the
        fast path): nothing changes the decoding rows until it ends.
Rule 4: at a boundary where every running request decodes and requests wait (arrivals
        the run crossed), :meth:`DecodeRuns._start_admitting` starts the step the fast
        path's whole step would start when the head is plain (one sequence, no prefix, no
        remote or resident KV) and the cap, the budget and the free blocks take it: the
        rows due grow, the plain heads are admitted with the steps of
        ``Scheduler.admit_head`` until one does not fit (where ``admit_head`` stops too)
        or one is not plain (the general loop, ``_admit_into_whole``, admits from there),
        and the step is priced from the same terms, without the passes over rest rows
        and the scheduler output (the admissions and the price:
        :func:`~inference_lab.core.engine.lean_admission.admit_plain`). Any other case is
        handed to ``_start_whole`` before anything changed.
Rule 5: the common end of an admission step in a run -- one running rest row (the
        admission, or a prefill chunk) follows the decoding rows -- is
        :meth:`DecodeRuns._end_admission`: ``complete_fast`` and ``complete_members`` for
        that one member inline (the same arithmetic in the same order; a run reports no
        tokens), the decoding rows finishing at that count then that row, when its last
        token it was, ended in row order (:meth:`DecodeRuns._drop_finishing`), and the
        row starting to decode when it emitted its first token. The end of a pure step
        with finishes that the run did not take in a stretch is the same without the
        rest row. Several rest rows after the decoding ones are
        ``FastPath.end_rest_rows``' (``complete_members``' arithmetic per row inline, no
        tokens; the finishes and the rows starting to decode as ``complete_fast``'s). Any
        other end (rows whose step changed) is ``complete_fast``'s.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

import attrs

from inference_lab.core.builders import frozen_builder
from inference_lab.core.decode_pricing import DecodeStep, decode_step
from inference_lab.core.engine.block_pool import BlockPool
from inference_lab.core.engine.kv_cache_manager import KVCacheManager
from inference_lab.core.engine.lean_admission import admit_plain
from inference_lab.core.engine.outputs import StepLog
from inference_lab.core.engine.request import RUNNING, Request
from inference_lab.core.engine.running_rows import PlainRequest, RunningRows
from inference_lab.core.engine.scheduler_output import Batch, SchedulerOutput
from inference_lab.core.engine.wait_queue import WaitQueue
from inference_lab.core.roofline import BatchTerms, Roofline, StepCost

__all__ = ["DecodeRun", "DecodeRuns"]

Price = Callable[[BatchTerms], StepCost]
Ended = list[tuple[Request, float, float]]

#: a running request's admission number: ``running`` is in that order (each request
#: appended takes the scheduler's next one, and removals keep the order)
_ADMIT_ORDER = attrgetter("admit_order")


@attrs.frozen
class DecodeRun:
    """What ``FastPath.decode_run`` did: the boundaries it handled, the steps it
    started, the time of its last boundary, and whether that one's next step is the
    caller's to start (``partial``: it ended the step in flight only)."""

    boundaries: int
    started: int
    last: float
    partial: bool


decode_run_result = frozen_builder(DecodeRun)


class DecodeRuns:
    """The decode runs' half of a worker's scheduler (a base of ``FastPath``). The
    attributes below are the scheduler's and its fast path's."""

    vec: RunningRows | None
    batch: Batch
    fast_batch: Batch
    pool: BlockPool
    waiting: WaitQueue
    running: list[Request]
    running_seqs: int
    roofline: Roofline
    budget: int
    total_blocks: int
    busy_seconds: float
    new_transfers: list[Request]
    pricers: dict[int, DecodeStep | None]
    #: the fewest running requests the fast path keeps (``FAST_PATH_MIN // 2``)
    fast_least: int
    step_terms: BatchTerms | None
    step_gamma: int
    step_id: int
    step_budget: int
    step_mark: int
    step_start: float
    step_end: float
    complete_fast: Callable[
        [float, list[tuple[int, int]], bool],
        tuple[tuple[tuple[int, int], ...], list[Request]],
    ]
    _schedule_whole: Callable[[float], SchedulerOutput | None]
    end_rest_rows: Callable[[RunningRows, float, float, Ended], bool]
    finish: Callable[[Request], None]
    _admit_into_whole: Callable[[float, int, int, RunningRows, list[int]], SchedulerOutput]
    grow_due: Callable[
        [RunningRows, int],
        tuple[list[tuple[PlainRequest, int]] | None, list[int] | None, int],
    ]
    grow_decoding: Callable[[RunningRows, list[tuple[PlainRequest, int]], list[int] | None], None]
    flat: tuple[int, int]
    room_flat: tuple[int, int, int]
    block_size: int
    kv: KVCacheManager
    #: the head whose blocks were short at the last lean admission (Rule 4): handed to
    #: ``_start_whole`` at once while it stays the head (which of the two starts a step
    #: changes nothing but the time it takes)
    blocked_head: Request | None = None
    max_num_seqs: int
    chunked: bool
    chunk_cap: int
    admit_order: Iterator[int]

    def fast_in_flight(self) -> bool:
        """Whether the step in flight is a fast step a decode run may end: the fast
        path's batch, no block being cached or evictable."""
        pool = self.pool
        return self.batch is self.fast_batch and not pool.filling and not pool.evictable

    def _end_in_run(
        self,
        vec: RunningRows,
        now: float,
        start: float,
        scratch: list[tuple[int, int]],
        ended: Ended,
    ) -> bool:
        """A decode run's boundary at ``now`` ends the fast step in flight (started at
        ``start``): for a pure decode step the decode counter moving on (and its finishes:
        Rule 5), for one rest row after the decoding rows :meth:`_end_admission`, else
        ``complete_fast``. Whether a request finished (in ``ended``)."""
        d = vec.decoding
        size = vec.size
        if size == d:
            if vec.g + 1 not in vec.finish_cal:
                _advance_pure(vec)
                return False
            if d == vec.step_decoding:
                finishing = vec.advance()
                assert finishing is not None
                self._drop_finishing(vec, finishing, None, now, start, ended)
                return True
        elif d == vec.step_decoding:
            if size == d + 1 and self.running[d].status == RUNNING:
                return self._end_admission(vec, now, start, ended)
            return self.end_rest_rows(vec, now, start, ended)
        _, done = self.complete_fast(now, scratch, False)  # the general end of a step
        scratch.clear()
        for r in done:
            ended.append((r, now, now - start))
        return bool(done)

    def _end_admission(self, vec: RunningRows, now: float, start: float, ended: Ended) -> bool:
        """Rule 5: :meth:`_end_in_run` for the common end of an admission step: one
        running rest row follows the decoding rows (``complete_fast`` and
        ``complete_members`` for that one member, inline; no tokens reported). Whether a
        request finished (in ``ended``)."""
        finishing = vec.advance()
        d = vec.decoding
        r = self.running[d]
        c = r.num_computed + vec.rest_n[0]
        r.num_computed = c
        prompt = r.prompt_tokens
        new = c - prompt + 1
        if new > r.max_tokens:
            new = r.max_tokens
        out = r.num_output
        # (c < prompt: a prefill chunk, no token yet; new <= out: a preempted request's
        # prefill again, its tokens are out)
        if c < prompt or new <= out:
            if finishing is None:
                return False
            self._drop_finishing(vec, finishing, None, now, start, ended)
            return True
        if out == 0:
            r.first_token_time = now
        r.num_output = new
        last = new >= r.target_tokens
        if finishing is not None:
            self._drop_finishing(vec, finishing, r if last else None, now, start, ended)
        elif last:
            self.finish(r)
            vec.drop([d])
            del self.running[d]
            ended.append((r, now, now - start))
        if last:
            return True
        vec.start_one(r)
        return finishing is not None

    def _drop_finishing(
        self,
        vec: RunningRows,
        finishing: list[Any],
        also: Request | None,
        now: float,
        start: float,
        ended: Ended,
    ) -> None:
        """The decoding rows ``finishing`` (the decode counter moved on to their finish),
        then the first rest row's ``also`` when it finished too, end as ``complete_fast``
        ends them: written back, freed, reported to ``ended`` and dropped, in row
        order."""
        running = self.running
        d = vec.decoding
        done = _rows_of(running, finishing, d)
        self._end_decoding(vec, done, now, start, ended)
        if also is not None:
            self.finish(also)
            ended.append((also, now, now - start))
            done.append(d)
        vec.drop(done)
        for i in reversed(done):
            del running[i]

    def _end_decoding(
        self, vec: RunningRows, done: list[int], now: float, start: float, ended: Ended
    ) -> None:
        """The decoding rows ``done`` (ascending) of a step from ``start`` ending at
        ``now``: written back, freed and reported to ``ended``, in row order (not yet
        dropped)."""
        running = self.running
        finish = self.finish
        for i in done:
            r = running[i]
            vec.finish_decoding(r)
            finish(r)
            ended.append((r, now, now - start))

    def grow_at(self, vec: RunningRows, g: int, extra: int = 0) -> bool:
        """The decoding rows filed to grow at ``g`` (the decode counter; some are) take
        their blocks, when the pool has them all and ``extra`` more (True); False
        (nothing changed) when it has not. The common case -- each row past its private
        blocks' table, one block each, filed ``block_size`` counts on -- is ``grow_due``
        and ``grow_decoding`` inline (the same test, the same calls to the KV cache
        manager)."""
        grow_cal = vec.grow_cal
        due = grow_cal[g]
        flat, tail = self.flat
        bs = self.block_size
        for r, c in due:
            room = r.block_room
            if room - c != g or room < flat or room != (r.num_blocks - tail) * bs:
                return self._grow_general(vec, g, extra)
        if len(due) + extra > self.pool.free:
            return False
        del grow_cal[g]
        self.kv.grow_by_one(due)
        later = grow_cal.get(g + bs)
        if later is None:
            grow_cal[g + bs] = due
        else:
            later += due
        return True

    def _grow_general(self, vec: RunningRows, g: int, extra: int) -> bool:
        """:meth:`grow_at` for rows that want other than one block each."""
        due, wants, need = self.grow_due(vec, g)
        if need + extra > self.pool.free:
            return False
        assert due is not None
        self.grow_decoding(vec, due, wants)
        return True

    def _pricer_for(self, vec: RunningRows, rows: int, priced: int) -> DecodeStep | None:
        """The decode pricer of a pure step of ``rows`` decoding rows (``priced``: the
        rows of the one in hand), made once per count; the rows' step fields set when
        the count changes. None with MLA classes (the general price)."""
        if rows == priced:
            return self.pricers[rows]
        vec.step_decoding = rows
        if vec.rest_n:
            vec.rest_n = []
        return self.decode_step_of(rows)

    def decode_step_of(self, rows: int) -> DecodeStep | None:
        """The decode pricer of a pure step of ``rows`` decoding rows, made once per count
        (None with MLA classes: the general price)."""
        pricers = self.pricers
        if rows not in pricers:
            k = None if self.roofline.has_mla() else self.roofline.decode_constants(rows)
            pricers[rows] = None if k is None else decode_step(k)
        return pricers[rows]

    def _cross(
        self,
        cross: Callable[[float], float | None],
        vec: RunningRows,
        pure: int,
        start: float,
        end: float,
    ) -> float | None:
        """Rule 2: the step in flight (from ``start`` to ``end``) is set as the run's
        last (a pure one, with ``pure`` pure steps not yet counted), then ``cross`` is
        asked for the run's next limit."""
        if pure:
            self._in_flight(vec, pure, start, end)
        return cross(end)

    def _count_pure(self, pure: int) -> None:
        """``pure`` pure decode steps started: counted in ``step_id`` (the marks of the
        steps after them count them)."""
        if pure:
            self.step_id += pure
            self.step_mark = self.step_id
            self.step_gamma = 0

    def _start_whole(self, now: float, price: Price, factor: float, log: StepLog) -> float | None:
        """A decode run's step that is not a pure decode one, started at ``now`` as
        ``EventLoop._start_step`` starts it: the fast path's whole step
        (``_schedule_whole``: admissions, prefill chunks; never a preemption), priced by
        ``price`` x ``factor``, its figures appended to ``log``. Its duration; None when
        the fast path does not take it (``schedule_fast``'s conditions; nothing changed).
        Its batch may be a list (a group or a prefix-caching request admitted: the fast
        path left)."""
        size = len(self.running)
        pool = self.pool
        if size < self.fast_least or self.running_seqs != size or pool.filling or pool.evictable:
            return None
        out = self._schedule_whole(now)
        if out is None:
            return None
        return self._priced_out(out, now, price, factor, log)

    def _start_next(
        self, vec: RunningRows, now: float, rows: int, price: Price, factor: float, log: StepLog
    ) -> float | None:
        """A decode run's step that is not a pure decode one (``rows``: the decoding rows):
        :meth:`_start_admitting` when requests wait beside them alone (Rule 4), else
        :meth:`_start_whole`."""
        if self.waiting.count and vec.size == rows:  # (arrivals crossed)
            return self._start_admitting(vec, now, price, factor, log)
        return self._start_whole(now, price, factor, log)

    def _start_admitting(
        self, vec: RunningRows, now: float, price: Price, factor: float, log: StepLog
    ) -> float | None:
        """Rule 4: :meth:`_start_whole` at a boundary where every running request decodes
        and requests wait (arrivals the run crossed), when the head is plain and the cap,
        the budget and the free blocks take it: the rows due grow, the plain heads are
        admitted with the steps of ``Scheduler.admit_head`` (until one of them does not
        fit, or a head that is not plain, whose admissions from there on are the general
        loop's) and the step is priced from the same terms, without the passes over rest
        rows and the scheduler output. Otherwise it is ``_start_whole``'s, before
        anything changed."""
        waiting = self.waiting
        r = waiting.peek()
        rows = vec.decoding
        left = self.budget - rows
        pool = self.pool
        if (
            r is None
            or r is self.blocked_head  # (an overloaded worker: its blocks short again)
            or len(self.running) != rows
            or rows < self.fast_least
            or self.running_seqs != rows
            or left <= 0
            or pool.filling
            or pool.evictable
        ):
            return self._start_whole(now, price, factor, log)
        n = self._plain_chunk(r, left)
        if n <= 0:
            return self._start_whole(now, price, factor, log)
        kv = self.kv
        p0, tail, bs = self.room_flat  # (blocks_for past the private blocks' table, inline)
        blocks = -(-n // bs) + tail if n >= p0 else kv.blocks_for(n)
        g = vec.g  # the rows due grow first, when the blocks suffice for them and the head
        if not (self.grow_at(vec, g, blocks) if g in vec.grow_cal else blocks <= pool.free):
            self.blocked_head = r  # (the whole step's, until it is not the head)
            return self._start_whole(now, price, factor, log)
        vec.rest_n = []
        vec.step_decoding = rows
        self.step_gamma = 0
        self.step_id += 1
        return admit_plain(self, vec, r, n, blocks, left, now, price, factor, log)

    def _plain_chunk(self, r: Request, left: int) -> int:
        """The positions the head ``r`` runs in a step with ``left`` tokens left, as
        ``Scheduler._admissible_head`` and ``_head_chunk`` give them for a plain request;
        0 when the cap or the budget stops the admissions there; -1 when ``r`` is not
        plain (one sequence, no prefix, no remote or resident KV)."""
        if r.n != 1 or r.cacheable_blocks or r.remote_positions or r.num_blocks:
            return -1
        if self.running_seqs + 1 > self.max_num_seqs:
            return 0
        out = r.num_output  # (r.prefill_length())
        n = r.prompt_tokens + (out - 1 if out > 1 else 0)
        if n > left:
            if not self.chunked:
                return 0
            n = left
        return n if n <= self.chunk_cap else self.chunk_cap

    def enter_running(self, r: Request, hit: int, blocks: int, now: float, mark: int) -> None:
        """The head of the waiting queue ``r`` admitted into the step marked ``mark``
        starting at ``now``: out of the queue, its ``hit`` cached positions and ``blocks``
        new blocks taken (``KVCacheManager.admit``), running in admission order. The one
        place both ``Scheduler.admit_head`` and a decode run's lean admission do it."""
        self.waiting.pop()
        self.kv.admit(r, hit, blocks, r.first_scheduled_time < 0)
        r.status = RUNNING
        r.admit_order = next(self.admit_order)
        if r.first_scheduled_time < 0:
            r.first_scheduled_time = now
        r.batch_mark = mark
        self.running.append(r)
        self.running_seqs += r.n

    def _priced_out(
        self, out: SchedulerOutput, now: float, price: Price, factor: float, log: StepLog
    ) -> float:
        """:meth:`_priced` for the scheduler output ``out`` (its terms summed when it has
        none: a batch that left the fast path)."""
        terms = out.terms
        if terms is None:
            assert out.positions is not None and out.contexts is not None
            terms = self.roofline.batch_terms(out.positions, out.contexts)
        return self._priced(out.batch, terms, now, price, factor, log)

    def _priced(
        self, batch: Batch, terms: BatchTerms, now: float, price: Price, factor: float, log: StepLog
    ) -> float:
        """The whole step ``batch`` (price terms ``terms``) started at ``now``: priced by
        ``price`` x ``factor``, set in flight, its figures appended to ``log``; its
        duration."""
        return self.set_priced(batch, terms, price(terms), now, factor, log)

    def set_priced(
        self,
        batch: Batch,
        terms: BatchTerms,
        cost: StepCost,
        now: float,
        factor: float,
        log: StepLog,
    ) -> float:
        """:meth:`_priced` for the price ``cost`` of ``terms``."""
        duration = cost.seconds * factor
        self.busy_seconds += duration
        self.batch = batch
        self.step_terms = terms
        self.step_start = now
        self.step_end = now + duration
        total = self.total_blocks  # (_log_step)
        roof = cost.roofline if cost.roofline > 0 else 1.0
        log.kv_usage.append((total - self.pool.free) / total)
        log.flop_util.append(cost.compute / roof)
        log.bw_util.append(cost.memory / roof)
        return duration

    def _start_pure(self, vec: RunningRows, price: Price, factor: float, log: StepLog) -> float:
        """A pure decode step started by the general price (MLA classes): its duration,
        added to the busy time, its figures appended to ``log``."""
        cost = price(self._decode_terms(vec, True))
        duration = cost.seconds * factor
        self.busy_seconds += duration
        _log_step(self, cost, log)
        return duration

    def _decode_terms(self, vec: RunningRows, mla: bool) -> BatchTerms:
        """The terms of a step of the decoding rows alone (as ``_admit_into_whole``)."""
        if mla:
            return self.roofline.batch_terms(vec.ns(), vec.computed_now(self.running))
        rows = vec.decoding
        return BatchTerms(rows, rows, vec.decode_totals(), [])

    def _in_flight(self, vec: RunningRows, pure: int, start: float, end: float) -> None:
        """The step in flight is a run's last started one, a pure decode step from
        ``start`` to ``end``, the last of ``pure`` not yet counted in ``step_id``: the
        fields ``_schedule_whole`` and the engine set for a step in flight, set (its
        terms left to :meth:`terms_in_flight`: Rule 3)."""
        self.step_id += pure
        self.step_mark = self.step_id
        self.step_gamma = 0
        self.step_budget = self.budget - vec.decoding
        self.step_terms = None
        self.step_start = start
        self.step_end = end

    def terms_in_flight(self) -> BatchTerms:
        """The price terms of the step in flight (Rule 3; a late arrival's join adds to
        them): those of a decode run's last pure step are worked out here."""
        terms = self.step_terms
        if terms is None:
            vec = self.vec
            assert vec is not None  # (a step in flight without terms is a decode run's)
            terms = self.step_terms = self._decode_terms(vec, self.roofline.has_mla())
        return terms

    def _settle(
        self,
        vec: RunningRows,
        boundaries: int,
        started: int,
        pure: int,
        start: float,
        end: float,
        boundary: float,
        partial: bool,
    ) -> DecodeRun:
        """A decode run ends, having started ``started`` steps, the last ``pure`` of them
        pure decode steps not yet counted in ``step_id``. Unless the run ends with a
        boundary whose next step is the caller's to start (``partial``), the step in flight
        is its last started one: for a pure one its fields are set here (a whole step set
        its own)."""
        if pure:
            if partial:
                self._count_pure(pure)
            else:
                self._in_flight(vec, pure, start, end)
        return decode_run_result(boundaries, started, boundary, partial)


def _rows_of(running: list[Request], finishing: list[Any], decoding: int) -> list[int]:
    """The rows of the decoding requests ``finishing``, ascending (``running`` is in
    admission order below ``decoding``: each found by bisection)."""
    done = []
    for r in finishing:
        i = bisect_left(running, r.admit_order, 0, decoding, key=_ADMIT_ORDER)
        done.append(i if i < decoding and running[i] is r else running.index(r, 0, decoding))
    if len(done) > 1:
        done.sort()
    return done


def _advance_pure(vec: RunningRows) -> None:
    """``RunningRows.advance`` inline for a count at which no decoding row finishes: the
    counter moves on and the windows' rows saturating at it move over."""
    g = vec.g + 1
    vec.g = g
    for j, window in vec.windowed:  # (a full-attention class never saturates)
        cal = vec.sat_cal[j]
        count = cal.pop(g, 0) if cal else 0
        if count:
            vec.sat[j] += count
            vec.unsat[j] -= count
            vec.unsat_sum[j] -= count * (window - 1 - g)


def _log_step(worker: DecodeRuns, cost: StepCost, log: StepLog) -> None:
    """A started step's figures appended to ``log``, as ``RunLoop._run_boundary`` appends
    them: the KV usage after its blocks were taken, and its utilisations."""
    total = worker.total_blocks
    roof = cost.roofline if cost.roofline > 0 else 1.0
    log.kv_usage.append((total - worker.pool.free) / total)
    log.flop_util.append(cost.compute / roof)
    log.bw_util.append(cost.memory / roof)
