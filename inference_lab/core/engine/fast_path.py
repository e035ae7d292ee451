"""The scheduler's fast path: a loaded worker's step taken whole, in O(1) plus its events.

When a worker runs many plain requests (``n = 1``) with neither speculative decoding nor
a block being cached or evictable, most of them decode: each step gives every one of them
one position and one token. The fast path keeps those **decoding rows** lazily
(:mod:`~inference_lab.core.engine.running_rows`: a decode counter, calendars of the counts
at which one finishes, needs a KV block or saturates a sliding window) and chooses and
completes a step that takes every running request whole in O(1) plus the step's events
and its other rows (admissions, prefill chunks).

Rule 1: a worker takes the fast path when it runs at least ``FAST_PATH_MIN`` plain
        requests (half as many once in it), none filling the prefix cache and no cached
        block evictable, and the step takes every running request whole (the budget holds
        all their chunks, the free blocks all their new blocks); any other step (a budget
        or free blocks too small for all, a group, a preemption, an abort) leaves it
        first (:meth:`FastPath.devectorise`) and takes the per-request loop.
Rule 2: a fast step is the same step the per-request loop would choose: every running
        request is in it, each with the same positions (so neither the order nor a
        preemption can change anything); the integers handed to the roofline are the same,
        so the price is the same to the last bit, and the events are the same.
Rule 3: this is the scheduler's other half (:class:`FastPath` is a base of
        :class:`~inference_lab.core.engine.scheduler.Scheduler`): it asks the KV cache
        manager for blocks like the per-request loop does and completes its other rows
        with the same arithmetic (``request.complete_members``).
Rule 4: a decode run (:meth:`~inference_lab.core.engine.decode_runs.DecodeRuns.decode_run`,
        a base of :class:`FastPath`) is the fast path's boundaries one after another
        without the engine's calendar in between, each ending the step in flight and
        starting the next one as a boundary handled alone does (decode_runs Rules 1-3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from inference_lab.core.decode_pricing import DecodeStep, TwoClasses
from inference_lab.core.engine.block_pool import BlockPool
from inference_lab.core.engine.decode_runs import DecodeRun, DecodeRuns, Ended, Price, _rows_of
from inference_lab.core.engine.kv_cache_manager import KVCacheManager
from inference_lab.core.engine.outputs import StepLog
from inference_lab.core.engine.request import RUNNING, Request, complete_members
from inference_lab.core.engine.running_rows import PlainRequest, RunningRows
from inference_lab.core.engine.scheduler_output import Batch, SchedulerOutput, scheduler_output
from inference_lab.core.engine.stretch import decode_stretch
from inference_lab.core.engine.wait_queue import WaitQueue
from inference_lab.core.roofline import BatchTerms, Roofline

__all__ = ["FAST_PATH_MIN", "DecodeRun", "FastBatch", "FastPath"]

#: A worker takes the fast path (Rule 1) when it runs at least this many plain requests,
#: and leaves it when it runs fewer than half as many: entering it costs a pass over the
#: rows. (Counted in instructions on gpt-oss-20b at 60 requests/s, whose batches hold ~30
#: requests, and on the default simulator benchmark, 8 does no worse than 16 or 32.)
FAST_PATH_MIN = 8


class FastPath(DecodeRuns):
    """The fast path's half of a worker's scheduler (Rule 3). The attributes below are the
    scheduler's (set by its ``__init__``)."""

    running: list[Request]
    running_seqs: int
    pool: BlockPool
    kv: KVCacheManager
    roofline: Roofline
    budget: int
    chunk_cap: int
    block_size: int
    waiting: WaitQueue
    batch: Batch
    step_terms: BatchTerms | None
    step_gamma: int
    step_id: int
    step_budget: int
    step_mark: int
    total_blocks: int
    busy_seconds: float
    admit_head: Callable[[float, int, int], tuple[Request, int] | None]
    finish: Callable[[Request], None]

    def init_fast_path(self, roofline: Roofline, *, allowed: bool) -> None:
        #: whether the deployment allows the fast path (no speculative decoding)
        self.fast_allowed = allowed
        #: the running requests' rows while in the fast path (None: not in it)
        self.vec: RunningRows | None = None
        self.fast_batch = FastBatch(self)  # (what its step in flight is, in the fast path)
        #: the roofline's decode pricer per count of decoding rows (decode runs)
        self.pricers: dict[int, DecodeStep | None] = {}
        #: from ``flat[0]`` positions on, ``blocks_for(p) = ceil(p / block_size) +
        #: flat[1]`` (the private blocks no longer grow)
        self.flat = roofline.flat_blocks()
        #: ``(p0, tail, block_size)``: ``room_for`` past the private blocks' table
        #: (``RunningRows.start_one``)
        self.room_flat = (*self.flat, self.block_size)
        self.fast_least = FAST_PATH_MIN // 2

    def sync_running(self) -> None:
        """Write the decoding requests' lazy ``num_computed`` and ``num_output`` back
        before a reader looks at the objects."""
        vec = self.vec
        if vec is not None:
            vec.sync(self.running[: vec.size])

    def devectorise(self) -> None:
        """Leave the fast path (Rule 1): the decoding requests take their counts back and
        a step in flight becomes the list of (request, positions) it stands for."""
        vec = self.vec
        if vec is None:
            return
        if self.step_terms is None and isinstance(self.batch, FastBatch):
            self.terms_in_flight()  # (a decode run's, worked out while the rows are there)
        rows = self.running[: vec.size]
        vec.sync(rows)
        if isinstance(self.batch, FastBatch):
            self.batch = list(zip(rows, vec.ns(), strict=True))
        self.vec = None

    def schedule_fast(self, now: float) -> SchedulerOutput | None:
        """The batch starting at ``now`` by the fast path, when Rule 1 lets it take it;
        None otherwise (having left the fast path if it was in it)."""
        size = len(self.running)
        pool = self.pool
        if (
            size >= (FAST_PATH_MIN if self.vec is None else FAST_PATH_MIN // 2)
            and self.running_seqs == size
            and not pool.filling
            and not pool.evictable
        ):
            chosen = self._schedule_whole(now)
            if chosen is not None:
                return chosen
        if self.vec is not None:
            self.devectorise()
        return None

    def grow_due(
        self, vec: RunningRows, g: int
    ) -> tuple[list[tuple[PlainRequest, int]] | None, list[int] | None, int]:
        """The decoding rows whose next position needs a block when the decode counter is
        ``g`` (filed in the grow calendar there), the blocks each wants (None: one each,
        the common case past the private blocks' table) and the blocks they need in all."""
        due = vec.grow_cal.get(g)
        if due is None:
            return None, None, 0
        flat, tail = self.flat
        bs = self.block_size
        for r, c in due:
            room = r.block_room
            if room - c != g or room < flat or room != (r.num_blocks - tail) * bs:
                blocks_for = self.kv.blocks_for
                wants = [blocks_for(c + g + 1) for _, c in due]
                need = 0
                for (q, _), want in zip(due, wants, strict=True):
                    if want > q.num_blocks:
                        need += want - q.num_blocks
                return due, wants, need
        return due, None, len(due)

    def _schedule_whole(self, now: float) -> SchedulerOutput | None:
        """Rule 1: the batch starting at ``now`` chosen over the rows, when the step takes
        every running request whole; None (nothing changed) otherwise.

        The rows ``[0, vec.decoding)`` are known to decode (one position each; lazily:
        :mod:`~inference_lab.core.engine.running_rows` Rule 4): only those filed to grow
        now and the others' chunks are worked out."""
        running = self.running
        k = len(running)
        vec = self.vec
        if vec is None:
            rf = self.roofline
            vec = self.vec = RunningRows(
                running, rf.room_for, windows=rf.window_classes(), flat=self.room_flat
            )
        decoding = vec.decoding
        budget = self.budget
        due, wants, need = self.grow_due(vec, vec.g)
        # the rows that do not decode: their positions and contexts, then admissions'
        rest_rows = running[decoding:k]
        rest_n: list[int] = []
        rest_c: list[int] = []
        grown: list[tuple[Request, int]] = []  # those that need blocks: their positions
        total = decoding
        if rest_rows:  # a step's admissions and prefill chunks: in Python, row by row
            cap = self.chunk_cap
            for r in rest_rows:
                c = r.num_computed
                left = r.prefill_length() - c
                n = (left if left < cap else cap) if left > 0 else 1
                rest_n.append(n)
                rest_c.append(c)
                total += n
                if c + n > r.block_room:
                    grown.append((r, c + n))
        if total > budget:
            return None
        kv = self.kv
        wanted: list[int] = []
        if grown:
            blocks_for = kv.blocks_for
            wanted = [blocks_for(p) for _, p in grown]
            for (r, _), w in zip(grown, wanted, strict=True):
                if w > r.num_blocks:
                    need += w - r.num_blocks
        if need > self.pool.free:
            return None
        for (r, _), w in zip(grown, wanted, strict=True):
            kv.grow_to(r, w)
        if due is not None:
            self.grow_decoding(vec, due, wants)
        vec.rest_n = rest_n
        vec.step_decoding = decoding
        self.step_gamma = 0
        self.step_id += 1
        mark = self.step_id
        return self._admit_into_whole(now, mark, budget - total, vec, rest_c)

    def grow_decoding(
        self, vec: RunningRows, due: list[tuple[PlainRequest, int]], wants: list[int] | None
    ) -> None:
        """The decoding rows ``due`` take the blocks their next position needs (``wants``
        each; None: one block each) and are filed for their next growth."""
        g = vec.g
        grow_cal = vec.grow_cal
        del grow_cal[g]
        if wants is None:  # one block each: all are filed block_size positions on
            self.kv.grow_by_one(due)
            bs = self.block_size
            later = grow_cal.get(g + bs)
            if later is None:
                grow_cal[g + bs] = due
            else:
                later += due
            return
        grow_to = self.kv.grow_to
        for entry, want in zip(due, wants, strict=True):
            r, c = entry
            grow_to(r, want)
            key = r.block_room - c
            slot = grow_cal.get(key)
            if slot is None:
                grow_cal[key] = [entry]
            else:
                slot.append(entry)

    def _admit_into_whole(
        self, now: float, mark: int, budget: int, vec: RunningRows, rest_c: list[int]
    ) -> SchedulerOutput:
        """Admissions into a fast step (marked ``mark``, ``budget`` tokens left) and its
        price's terms; a group or a request that fills the prefix cache leaves the fast
        path and the step becomes a list (Rule 1)."""
        pool = self.pool
        batch: Any = self.fast_batch
        ns: Any = None
        cs: Any = None
        while budget > 0 and self.waiting.count:
            admitted = self.admit_head(now, mark, budget)
            if admitted is None:
                break
            r, n = admitted
            if isinstance(batch, FastBatch) and (r.n != 1 or pool.filling):
                rows = self.running[: vec.size]
                self.devectorise()
                batch = list(zip(rows, vec.ns(), strict=True))
                ns = [n for _, n in batch]
                cs = [q.num_computed for q, _ in batch]
            if isinstance(batch, FastBatch):
                vec.append(n)  # (to rest_n)
                rest_c.append(r.num_computed)
            else:
                batch.append((r, n))
                ns.append(n)
                cs.append(r.num_computed)
            budget -= n
        self.step_budget = budget
        self.step_mark = mark
        if not isinstance(batch, FastBatch):
            return scheduler_output(batch, ns, cs, None, 0)
        rf = self.roofline
        decoding = vec.decoding
        rest_n = vec.rest_n
        if rf.has_mla():
            terms = rf.batch_terms(vec.ns(), vec.computed_now(self.running))
        elif rest_n:
            terms = vec.terms_with(rest_n, rest_c)  # (decode_terms_of's, in one pass)
        else:
            terms = BatchTerms(decoding, decoding, vec.decode_totals(), [])  # (the same)
        return scheduler_output(batch, None, None, terms, 0)

    def complete_fast(
        self, now: float, emit: list[tuple[int, int]], tokens: bool = True
    ) -> tuple[tuple[tuple[int, int], ...], list[Request]]:
        """``Scheduler.complete`` for a fast step: every row was in the step, each at its
        ``n``; the same tokens, first-token times and completions, in row order. The rows
        ``[0, step_decoding)`` decoded: each emits one token (the decode counter moves on;
        their finishes are the ones filed for it), returned as one tuple (an empty one
        when ``tokens`` is False: a decode run, which reports none); the rows after them
        that emitted for the first time decode from now on."""
        vec = self.vec
        assert vec is not None  # a FastBatch in flight
        k = vec.size
        decoding = vec.step_decoding
        running = self.running
        # the decoding rows' positions and tokens, lazily; those whose last token it was
        finishing: list[Any] | None = vec.advance()
        head = vec.head if tokens else ()  # the decoding rows' (id, 1) each, kept while
        if head is None:  # they stay the same
            head = vec.head = tuple(vec.pairs)
        done = [] if finishing is None else _rows_of(running, finishing, decoding)
        still = k  # the first row that did not emit (k: none)
        if decoding < k:  # the others: the per-request loop's arithmetic
            members = (
                ((running[decoding], vec.rest_n[0]),)  # (one: an admission's end, mostly)
                if k - decoding == 1
                else list(zip(running[decoding:k], vec.rest_n, strict=True))
            )
            rest_done, rest_still = complete_members(members, now, emit)
            done += [decoding + i for i in rest_done]
            if rest_still < len(members):
                still = decoding + rest_still
        finished: list[Request] = []
        if done:
            for i in done:
                r = running[i]
                if i < decoding:
                    vec.finish_decoding(r)
                self.finish(r)
                finished.append(r)
            still = self._drop_rows(vec, done, still, k)
        if still > vec.decoding:
            vec.start_decoding(running[vec.decoding : still])
        return head, finished

    def _drop_rows(self, vec: RunningRows, done: list[int], still: int, k: int) -> int:
        """The rows ``done`` (ascending, finished) dropped from ``vec`` and the running
        list; returns ``still`` (the first rest row that emitted nothing, ``k``: none)
        as its index after the drop."""
        vec.drop(done)
        running = self.running
        for i in reversed(done):
            del running[i]
        return still - (len(done) if still == k else sum(1 for i in done if i < still))

    def end_rest_rows(self, vec: RunningRows, now: float, start: float, ended: Ended) -> bool:
        """decode_runs Rule 5: ``complete_fast`` for a decode run's step (from ``start``)
        ending at ``now`` with several rest rows after the decoding ones, the rows' step
        unchanged: ``complete_members``' arithmetic per rest row inline (a run reports no
        tokens), then the same finishes in row order (each to ``ended``) and the same rows
        starting to decode. Whether a request finished."""
        finishing = vec.advance()
        d = vec.decoding
        k = vec.size
        running = self.running
        last, still = _complete_rest(running, vec.rest_n, d, k, now)
        if finishing is not None or last:
            done = [] if finishing is None else _rows_of(running, finishing, d)
            self._end_decoding(vec, done, now, start, ended)
            finish = self.finish
            for i in last:
                r = running[i]
                finish(r)
                ended.append((r, now, now - start))
            done += last
            still = self._drop_rows(vec, done, still, k)
        if still > vec.decoding:
            vec.start_decoding(running[vec.decoding : still])
        return finishing is not None or bool(last)

    def finish_in_stretch(
        self, vec: RunningRows, now: float, start: float, ended: Ended
    ) -> TwoClasses | None:
        """stretch Rule 4: the pure decode step in flight (from ``start``) ends at ``now``
        and its end finishes the decoding rows filed at the next count: as
        ``complete_fast`` ends it (the counter moves on, the rows are written back, freed
        and dropped in row order, each to ``ended``), when the others still hold the fast
        path and a pure step of them has two-class constants (returned, the rows' step
        fields set); None, nothing changed, otherwise."""
        finishing = vec.finish_cal[vec.g + 1]
        rows = vec.decoding - len(finishing)
        if rows < self.fast_least:
            return None
        step = self.decode_step_of(rows)
        two = None if step is None else step.two
        if two is None:
            return None
        vec.advance()
        self._drop_finishing(vec, finishing, None, now, start, ended)
        vec.step_decoding = rows
        return two

    # ------------------------------------------------------------------ decode runs
    def decode_run(
        self,
        now: float,
        limit: float,
        price: Price,
        factor: float,
        log: StepLog,
        ended: Ended,
        *,
        stop_after_finish: bool = False,
        cross: Callable[[float], float | None] | None = None,
    ) -> DecodeRun | None:
        """decode_runs Rule 1: handle this worker's boundaries from the one due at ``now``
        while each is earlier than ``limit``: each ends the fast step in flight (requests
        finishing go to ``ended`` with its time and the duration of the step that ended
        them) and starts the next one, priced as the engine prices it (``price`` x
        ``factor``, figures to ``log``). At a boundary whose next step the fast path does
        not take, or after a finish with ``stop_after_finish``, it ends the step in flight
        only (``partial``). When a step ends at or past ``limit``, ``cross`` (if given)
        is asked for a later one (Rule 2). None when the boundary at ``now`` is not the
        end of a fast step (nothing changed). Called by ``RunLoop._run_boundary``."""
        vec = self.vec
        if vec is None or now >= limit or not self.fast_in_flight():
            return None
        grow_cal = vec.grow_cal
        waiting = self.waiting
        budget = self.budget
        least = self.fast_least
        scratch: list[tuple[int, int]] = []
        finishes = None if stop_after_finish else ended  # (a stretch may end requests)
        boundaries = started = pure = 0  # (pure: pure steps not yet counted in step_id)
        priced_rows = -1  # (the rows of the pricer in hand; -1: none)
        start = self.step_start  # (of the step in flight: the first boundary ends it)
        boundary = now
        while True:
            if now >= limit:
                later = None if cross is None else self._cross(cross, vec, pure, start, now)
                pure = pure if cross is None else 0
                if later is None:
                    return self._settle(vec, boundaries, started, pure, start, now, boundary, False)
                limit = later
            boundary = now
            boundaries += 1
            if self._end_in_run(vec, now, start, scratch, ended) and stop_after_finish:
                return self._settle(vec, boundaries, started, pure, start, now, boundary, True)
            rows = vec.decoding
            g = vec.g
            pure_next = not waiting.count and vec.size == rows and least <= rows <= budget
            if pure_next and g in grow_cal:
                pure_next = self.grow_at(vec, g)
            if not pure_next:  # (blocks short: _start_whole declines too)
                self._count_pure(pure)
                pure = 0
                duration = self._start_next(vec, now, rows, price, factor, log)
                if duration is None:  # not the fast path's step: the caller's to start
                    return self._settle(vec, boundaries, started, 0, start, now, boundary, True)
                started += 1
                start = now
                now = now + duration
                if self.vec is not vec or self.new_transfers:  # (the caller files them)
                    return self._settle(vec, boundaries, started, 0, start, now, boundary, False)
                priced_rows = -1
                continue
            pricer = self._pricer_for(vec, rows, priced_rows)
            priced_rows = rows
            if pricer is None:  # (MLA classes: a step at a time, by the general price)
                start = now
                now = now + self._start_pure(vec, price, factor, log)
                started += 1
                pure += 1
                continue
            run = decode_stretch(self, vec, pricer, now, limit, factor, log, finishes)
            started += run.started
            pure += run.started
            boundaries += run.boundaries
            start, now, boundary = run.start, run.end, run.boundary  # (ours: none handled)
            if run.short:  # (the caller's step: the per-request loop's)
                return self._settle(vec, boundaries, started, pure, start, now, boundary, True)


class FastBatch:
    """The step in flight of a worker in the fast path: every row, each at its ``n`` (1
    for the decoding ones). Iterating it (the paths that need the objects) syncs them
    first; appending a plain request adds its row, a group leaves the fast path."""

    __slots__ = ("worker",)

    def __init__(self, worker: FastPath) -> None:
        self.worker = worker

    def _rows(self) -> RunningRows:
        vec = self.worker.vec
        assert vec is not None  # the worker leaves the fast path through devectorise()
        return vec

    def __len__(self) -> int:
        return self._rows().size

    def __iter__(self) -> Iterator[tuple[Request, int]]:
        w = self.worker
        vec = self._rows()
        rows = w.running[: vec.size]
        vec.sync(rows)
        return iter(list(zip(rows, vec.ns(), strict=True)))

    def append(self, item: tuple[Request, int]) -> None:
        """A request admitted into the step in flight (a late arrival, engine Rule 2)."""
        r, n = item
        w = self.worker
        if r.n != 1 or w.pool.filling:
            w.devectorise()
            w.batch.append(item)
            return
        self._rows().append(n)


def _complete_rest(
    running: list[Request], rest_n: list[int], d: int, k: int, now: float
) -> tuple[list[int], int]:
    """``complete_members`` for the rest rows ``running[d:k]`` (at ``rest_n``) of a decode
    run's step ending at ``now``, without their tokens: the rows whose last token it was,
    and the first row that emitted nothing (``k``: none)."""
    last: list[int] = []
    still = k
    for i, n in enumerate(rest_n, d):
        r = running[i]
        if r.status != RUNNING:
            continue
        c = r.num_computed + n
        r.num_computed = c
        prompt = r.prompt_tokens
        if c >= prompt:
            new = c - prompt + 1
            if new > r.max_tokens:
                new = r.max_tokens
            out = r.num_output
            if new > out:
                if out == 0:
                    r.first_token_time = now
                r.num_output = new
                if new >= r.target_tokens:
                    last.append(i)
                continue
        if still == k:
            still = i
    return last, still
