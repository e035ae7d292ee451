"""The engine: one deployment's workers behind a router, and the event calendar.

A pure discrete-event simulation with the h11 shape: ``submit``, ``abort``,
``next_event_time``, ``step``, ``statistics``; outputs are frozen event objects
(:mod:`~inference_lab.core.engine.outputs`). It drives both ``inference-lab sim`` (as fast
as the CPU allows) and the serve runtime (paced to wall-clock). Each worker's scheduler
(:mod:`~inference_lab.core.engine.scheduler`) chooses its batches and asks its KV cache
manager for blocks; the engine files arrivals and step boundaries in the calendar, prices
each batch with the roofline and reports what became visible.

Rule 1: no trio, quart, hypercorn, ``time`` or global ``random``: time is a number of
        simulated seconds passed in and out (a test walks this package's imports).
Rule 2: a step's batch is chosen at its start time and its tokens and completions happen at
        its end time: both are returned by the one ``step()`` call that handles the event at
        that time (the step boundary), which also chooses the next batch. So an arrival
        stamped before a boundary joins the batch that starts at that boundary -- also when
        it reaches the engine after that boundary was handled (a paced caller hands arrivals
        over with a delay): if the step in flight started after the arrival's stamp
        and nothing else is waiting, the arrival joins it when the step has room (cap,
        token budget, blocks), and the step is priced again with it (its end moves later;
        the ``StepInfo`` reported at its start is not revised).
Rule 3: KV blocks are conserved: a worker's free blocks plus the blocks held by its
        running requests always equal its total, whatever is finished, preempted or
        aborted (the KV cache manager's books: its Rule 1, the block pool's Rule 1).
Rule 4: with prefix caching on, a request carrying block hashes is admitted with the
        prefix its worker has cached already: those positions count as computed (no FLOPs,
        no step tokens) while attention still reads them (the roofline sees them as the
        context ``c`` of its first chunk). A request without hashes, or prefix caching
        off, is scheduled exactly as if the cache did not exist.
Rule 5: speculative decoding (:mod:`~inference_lab.core.engine.drafting`) and
        data-parallel attention ranks in lockstep
        (:mod:`~inference_lab.core.engine.dp_group`) are priced as one step each.
Rule 6: events at the same time are handled in the order they were filed; an arrival
        submitted with ``preorder`` is filed as if it had been submitted before the first
        step (:mod:`~inference_lab.core.engine.calendar`), so an open loop fed to the
        engine lazily, in arrival order and never later than its arrival time, runs
        exactly as if every arrival had been submitted first.
Rule 7: ``frontend_latency`` (seconds, ``[scheduler]``) is what a real server's API
        process takes before its engine sees a request: a request submitted with
        ``arrival_time`` t is an arrival at ``t + frontend_latency`` to everything here
        (its event, its stamp for Rule 2), while the ``Finished`` it ends with reports
        ``arrival_time`` t, so its TTFT, queue time and E2E include the latency.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from inference_lab.core.config import Deployment
from inference_lab.core.engine.block_pool import KVEvent
from inference_lab.core.engine.calendar import ARRIVAL, BOUNDARY, GROUP_BOUNDARY, EventCalendar
from inference_lab.core.engine.dp_group import DPGroup
from inference_lab.core.engine.drafting import (
    DraftCounts,
    draft,
    plain_equivalent,
    price_lockstep,
    price_step,
)
from inference_lab.core.engine.fast_path import FastBatch
from inference_lab.core.engine.limits import check_fits, fits_total
from inference_lab.core.engine.outputs import (
    EngineStatistics,
    Finished,
    QueueView,
    StepEvents,
    StepInfo,
    engine_statistics,
    step_events,
    step_info,
)
from inference_lab.core.engine.request import (
    DONE,
    PENDING,
    RUNNING,
    WAITING,
    Request,
    RequestSpec,
)
from inference_lab.core.engine.router import Router
from inference_lab.core.engine.scheduler import Scheduler
from inference_lab.core.roofline import Roofline, StepCost
from inference_lab.core.speculative import AcceptanceDraws, RateAcceptance, expected_length
from inference_lab.errors import RequestRefused

__all__ = ["Engine"]


class Engine:
    """One deployment: ``replicas`` workers behind a router (``replicas * dp_attention``
    with data-parallel attention ranks), and the event calendar.

    Called by ``inference-lab sim`` (as fast as the CPU allows) and by the serve runtime's
    engine task (paced to wall-clock). Not thread-safe; every method is synchronous.
    ``acceptance`` replaces the speculative decoding draws of ``[speculative]`` (a seeded
    :class:`~inference_lab.core.speculative.RateAcceptance`) with the caller's.
    """

    #: Every step lasts this many times its roofline time (the test harness's slowdown).
    step_time_factor = 1.0

    def __init__(
        self,
        deployment: Deployment,
        *,
        record_kv_events: bool = False,
        acceptance: AcceptanceDraws | None = None,
    ) -> None:
        self.deployment = deployment
        self.roofline = Roofline(deployment)
        self._kv_events: list[KVEvent] | None = [] if record_kv_events else None
        self.workers = [
            Scheduler(i, deployment, self.roofline, self._kv_events)
            for i in range(deployment.workers)
        ]
        hw = deployment.hardware
        dp = hw.dp_attention
        self.groups = (
            [DPGroup(self.workers[i : i + dp]) for i in range(0, len(self.workers), dp)]
            if dp > 1
            else []
        )
        #: each worker's lockstep group (None: it steps alone)
        self._group_of: list[DPGroup | None] = [None] * len(self.workers)
        for g in self.groups:
            for w in g.ranks:
                self._group_of[w.index] = g
        spec = deployment.speculative
        self._spec = spec
        self._accept: AcceptanceDraws | None = None
        if spec is not None:
            self._accept = (
                acceptance
                if acceptance is not None
                else RateAcceptance(deployment.acceptance_rates, spec.seed)
            )
        self.now = 0.0
        self._calendar = EventCalendar()
        self._ids = itertools.count(1)
        self._requests: dict[int, Request] = {}
        self._router = Router(hw.router, hw.affinity_load_ratio, hw.kv_aware_queue_weight)
        self._pending = 0
        self._preemptions = 0
        self._steps = 0
        self._finished = 0
        self._aborted = 0
        self._max_num_seqs = deployment.scheduler.max_num_seqs
        #: a plain request of at most this many positions passes every check of check_fits
        self._fits_total = fits_total(deployment, self.roofline)
        #: seconds from a request's arrival to its entering the engine (Rule 7)
        self._frontend = deployment.scheduler.frontend_latency

    # ------------------------------------------------------------------ admission
    def check_fits(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> RequestRefused | None:
        """Why a request of this size (``n`` sequences sharing the prompt) can never run
        here, or None (:func:`~inference_lab.core.engine.limits.check_fits`). Pure: the
        serving layer calls it before admission to answer 400
        ``context_length_exceeded``."""
        return check_fits(self.deployment, self.workers[0].kv, prompt_tokens, max_tokens, n)

    def submit(self, spec: RequestSpec, *, preorder: int | None = None) -> int:
        """Queue an arrival at ``max(spec.arrival_time, now)`` and return its id. Nothing
        enters a worker until ``step()`` handles the arrival. Raises RequestRefused for a
        request that can never fit, and ValueError for a malformed spec.

        ``preorder`` (the simulator's lazy feed of an open loop, Rule 6) files the arrival
        among events as if it had been submitted before the engine's first step, as the
        ``preorder``-th such arrival: an event at the same time comes after it. The caller
        submits it before handling any event later than its arrival time."""
        if spec.prompt_tokens < 1 or spec.max_tokens < 1 or spec.n < 1:
            raise ValueError("prompt_tokens, max_tokens and n must be >= 1")
        target = spec.max_tokens if spec.target is None else spec.target
        if not 1 <= target <= spec.max_tokens:
            raise ValueError(f"target must be in 1..max_tokens, got {target}")
        if spec.worker is not None and not 0 <= spec.worker < len(self.workers):
            raise ValueError(f"worker must be in 0..{len(self.workers) - 1}, got {spec.worker}")
        if spec.n != 1 or spec.prompt_tokens + spec.max_tokens > self._fits_total:
            refused = self.check_fits(spec.prompt_tokens, spec.max_tokens, spec.n)
            if refused is not None:
                raise refused
        rid = next(self._ids)
        stamp = spec.arrival_time + self._frontend if self._frontend else spec.arrival_time
        arrival = stamp if stamp > self.now else self.now
        r = Request(rid, spec, arrival, target, stamp)
        self.workers[0].kv.prepare(r)  # the same answer on every worker
        self._requests[rid] = r
        self._pending += 1
        self._calendar.file_arrival(r, arrival, preorder)
        return rid

    def abort(self, request_id: int) -> bool:
        """Remove a request wherever it is; free its blocks; it emits nothing more.
        Idempotent: returns False when the id is unknown, finished or already aborted."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        if r.status == PENDING:
            self._pending -= 1  # its calendar entry goes stale
        elif r.status == WAITING:
            self.workers[r.worker].waiting.remove(r)
        elif r.status == RUNNING:
            w = self.workers[r.worker]
            w.devectorise()
            w.kv.free(r)
            w.running.remove(r)
            w.running_seqs -= r.n
        r.status = DONE
        self._aborted += 1
        return True

    # ------------------------------------------------------------------ time
    def next_event_time(self) -> float | None:
        return self._calendar.next_time()

    def advance_to(self, t: float) -> None:
        """Move the clock forward to ``t`` (only past idle time: never past an event)."""
        nxt = self.next_event_time()
        if nxt is not None and t > nxt:
            raise ValueError(f"cannot advance to {t}: an event is due at {nxt}")
        if t > self.now:
            self.now = t

    def is_idle(self) -> bool:
        return self.next_event_time() is None and all(
            not w.running and not w.waiting.count for w in self.workers
        )

    # ------------------------------------------------------------------ admission ledger
    def _probe(self, spec: RequestSpec) -> Request:
        """A request not submitted, as the router and the block counts see it."""
        r = Request(0, spec, self.now, spec.max_tokens, self.now)
        self.workers[0].kv.prepare(r)
        return r

    def route(self, spec: RequestSpec, extra: Sequence[int], *, advance: bool = True) -> int:
        """Route ``spec`` now, before it is submitted (it then carries the worker): the
        router's choice with ``extra[i]`` requests already routed to worker ``i`` and not
        yet arrived. A round robin advances unless ``advance`` is False (a look at the
        choice). For the serving layer, whose admission must know the worker a request
        will wait on."""
        router = self._router
        rr = router.rr
        index = router.choose(self.workers, self._probe(spec), extra).index
        if not advance:
            router.rr = rr
        return index

    def first_chunk_blocks(self, spec: RequestSpec, worker: int) -> int:
        """Free blocks admitting ``spec`` on ``worker`` would take now (its first chunk
        beyond what that worker has cached, and the cached blocks it takes)."""
        return self.workers[worker].first_chunk_blocks(self._probe(spec))

    def free_seqs(self) -> int:
        """Sequences under ``max_num_seqs`` not running, summed over workers (a worker
        running more than a lowered cap counts 0). O(workers)."""
        return sum(max(0, w.max_num_seqs - w.running_seqs) for w in self.workers)

    def queue_views(self) -> tuple[QueueView, ...]:
        """Each worker's running sequences, cap, free blocks and waiting queue in admission
        order (:class:`QueueView`), for the serving layer's admission ledger. Pure;
        O(queued requests)."""
        return tuple(
            QueueView(
                running_seqs=w.running_seqs,
                max_num_seqs=w.max_num_seqs,
                free_blocks=w.free_blocks - (w.verify_reserve() if w.spec is not None else 0),
                queued=tuple((r.n, w.first_chunk_blocks(r)) for r in w.waiting.in_order()),
            )
            for w in self.workers
        )

    def time_to_next_finish(self, now: float) -> float | None:
        """Seconds from ``now`` (simulated time, at or after the last event handled) until
        the first running request is expected to finish (each worker's
        :meth:`Scheduler.time_to_next_finish`); None when nothing runs."""
        spec = self._spec
        best: float | None = None
        for w in self.workers:
            per_step = 1.0
            if spec is not None:
                gamma = spec.gamma_for(w.running_seqs)
                per_step = expected_length(self.deployment.acceptance_rates, gamma)
            eta = w.time_to_next_finish(now, per_step)
            if eta is not None and (best is None or eta < best):
                best = eta
        return best

    # ------------------------------------------------------------------ events
    def step(self) -> StepEvents:
        """Handle the earliest event and return what became visible at its time."""
        t, kind, payload = self._calendar.pop()
        if t > self.now:
            self.now = t
        now = self.now
        if kind == ARRIVAL:
            self._arrive(payload, now)
            return step_events(now, (), (), (payload.id,), None)
        if kind == GROUP_BOUNDARY:
            return self._group_boundary(payload, now)
        return self._boundary(payload, now)

    def take_arrivals(self, before: float) -> int:
        """Handle the arrivals at the head of the event queue stamped before ``before``,
        up to the first other event: exactly what as many ``step()`` calls would do, in
        the same order, without a ``StepEvents`` each (each would report only its
        request in ``arrived``). Returns how many it handled (0: the next event is not
        such an arrival). For a caller that only counts arrivals: the simulator's loop."""
        take = self._calendar.pop_arrival_before
        count = 0
        while (arrival := take(before)) is not None:
            t, r = arrival
            if t > self.now:
                self.now = t
            self._arrive(r, self.now)
            count += 1
        return count

    def _arrive(self, r: Request, now: float) -> None:
        """The arrival of ``r`` at ``now``: it enters its worker's waiting queue, which
        steps at ``now`` if idle (or takes it into the step in flight: Rule 2)."""
        self._pending -= 1
        hint = r.routed_worker
        workers = self.workers
        if hint is not None:
            w = workers[hint]
        else:  # (one worker: the router's answer, without asking)
            w = workers[0] if len(workers) == 1 else self._router.choose(workers, r)
        r.worker = w.index
        r.status = WAITING
        w.waiting.push(r)
        g = self._group_of[w.index]
        if g is not None:
            if not g.scheduled:
                g.scheduled = True
                self._calendar.file_boundary(g, now, GROUP_BOUNDARY)
            elif g.busy and r.stamped_time < g.step_start and w.waiting.count == 1:
                self._join_late(w, r)
        elif not w.scheduled:
            w.scheduled = True
            self._calendar.file_boundary(w, now, BOUNDARY)
        elif r.stamped_time < w.step_start and w.waiting.count == 1 and w.batch:
            self._join_late(w, r)

    def _join_late(self, w: Scheduler, r: Request) -> None:
        """``r`` reached the engine after the boundary of the step in flight although it
        arrived (``stamped_time``) before it (the caller took time to hand it over): it
        joins that step, as it would have at the boundary, if the step has room for it
        (Rule 2). The step is priced again with it and its end moves accordingly; the
        tokens of the step's other members were not yet emitted, so none is observed
        early."""
        g = self._group_of[w.index]
        start = w.step_start if g is None else g.step_start
        admitted = w.admit_head(start, w.step_mark, w.step_budget)
        if admitted is None:
            return
        _, n = admitted
        r.arrival_time = r.stamped_time  # it is treated as having arrived when stamped
        w.batch.append(admitted)
        terms = w.step_terms
        assert terms is not None  # set with the step in flight
        rf = self.roofline
        rf.add_sequence(terms, n, r.num_computed)
        if w.step_plain is not None:  # a speculative step: its batch without drafts too
            rf.add_sequence(w.step_plain, n, r.num_computed)
            w.step_pns.append(n)
            w.step_cs.append(r.num_computed)
        w.step_budget -= n
        if g is not None:  # a rank idle in its group's step gets its first member
            w.step_start = start
            cost, _ = price_lockstep(rf, g.ranks)
            end = start + cost.seconds * self.step_time_factor
            for rank in g.ranks:
                rank.step_end = end
            self._calendar.file_boundary(g, end, GROUP_BOUNDARY)
            return
        cost = rf.price(terms) if w.step_plain is None else price_step(rf, w)[0]
        end = w.step_start + cost.seconds * self.step_time_factor
        w.step_end = end
        self._calendar.file_boundary(w, end, BOUNDARY)

    def _complete(
        self, w: Scheduler, now: float, emit: list[tuple[int, int]], finished: list[Finished]
    ) -> tuple[tuple[int, int], ...]:
        """The step of ``w`` that ends at ``now`` (its scheduler's ``complete``), and a
        ``Finished`` for each request that ended with it. Returns the tokens of its first
        members (the fast path's decoding rows: one each), which come before those it
        adds to ``emit``."""
        head, done = w.complete(now, emit)
        for r in done:
            del self._requests[r.id]
            self._finished += 1
            finished.append(r.report(now, w.index, self._frontend))
        return head

    def _boundary(self, w: Scheduler, now: float) -> StepEvents:
        """The step of ``w`` ends at ``now``: complete it, then choose, price and file its
        next one (none: the worker idles until an arrival)."""
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        head = self._complete(w, now, tokens, finished)
        out = w.schedule(now)
        batch = out.batch
        preempted = out.preempted
        self._preemptions += preempted
        info = None
        if type(batch) is FastBatch or batch:  # (a FastBatch is never empty)
            rf = self.roofline
            if self._accept is None:
                terms = out.terms
                if terms is None:
                    assert out.positions is not None and out.contexts is not None
                    terms = rf.batch_terms(out.positions, out.contexts)
                cost = rf.price(terms)
                w.step_terms = terms
            else:
                assert isinstance(batch, list)  # (speculation keeps the fast path off)
                counts = draft(rf, self._accept, w, batch)
                cost, plain = price_step(rf, w)
                assert w.step_terms is not None  # set by draft
                terms = w.step_terms
            duration = cost.seconds * self.step_time_factor
            w.batch = batch
            w.step_start = now
            w.step_end = now + duration
            self._calendar.file_boundary(w, now + duration, BOUNDARY)
            self._steps += 1
            roof = cost.roofline if cost.roofline > 0 else 1.0
            info = step_info(
                worker=w.index,
                start=now,
                duration=duration,
                num_seqs=terms.seqs,
                num_tokens=terms.tokens,
                kv_usage=(w.total_blocks - w.pool.free) / w.total_blocks,
                flop_util=cost.compute / roof,
                bw_util=cost.memory / roof,
                preempted=preempted,
            )
            if self._accept is not None:
                info = self._with_drafts(info, counts, plain, [w])
        else:
            w.batch = []
            w.scheduled = False
        emitted = head + tuple(tokens) if tokens else head if head else ()
        return step_events(now, emitted, tuple(finished) if finished else (), (), info)

    def _with_drafts(
        self, info: StepInfo, counts: DraftCounts, plain: StepCost, ranks: list[Scheduler]
    ) -> StepInfo:
        """``info`` with a speculative step's draft counts and its plain equivalent."""
        return attrs.evolve(
            info,
            drafts=counts.drafts,
            draft_tokens=counts.draft_tokens,
            accepted_tokens=counts.accepted_tokens,
            accepted_per_position=tuple(counts.per_position),
            plain_duration=plain_equivalent(
                self.roofline, plain, ranks, counts, self.step_time_factor
            ),
        )

    def _group_boundary(self, g: DPGroup, now: float) -> StepEvents:
        """The lockstep step of a replica's ranks ends at ``now`` (dp_group Rule 1): each
        rank completes its part and chooses its next batch, and they start together,
        priced as one step."""
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        for w in g.ranks:
            rest = len(tokens)
            head = self._complete(w, now, tokens, finished)
            if head:  # this rank's first tokens, before those it added
                tokens[rest:rest] = head
        preempted = 0
        counts = DraftCounts()
        any_batch = False
        rf = self.roofline
        for w in g.ranks:
            out = w.schedule(now)
            batch = out.batch
            preempted += out.preempted
            w.batch = batch
            if self._accept is not None:
                assert isinstance(batch, list)  # (speculation keeps the fast path off)
                counts.add(draft(rf, self._accept, w, batch))
            elif out.terms is not None:  # the fast path summed them
                w.step_terms = out.terms
            else:
                assert out.positions is not None and out.contexts is not None
                w.step_terms = rf.batch_terms(out.positions, out.contexts)
            if batch:
                any_batch = True
        self._preemptions += preempted
        if not any_batch:
            g.scheduled = False
            g.busy = False
            return StepEvents(
                time=now, tokens=tuple(tokens), finished=tuple(finished), arrived=(), step=None
            )
        cost, plain = price_lockstep(rf, g.ranks)
        duration = cost.seconds * self.step_time_factor
        g.busy = True
        g.step_start = now
        for w in g.ranks:
            w.step_start = now
            w.step_end = now + duration
        self._calendar.file_boundary(g, now + duration, GROUP_BOUNDARY)
        self._steps += 1
        roof = cost.roofline if cost.roofline > 0 else 1.0
        used = sum(w.total_blocks - w.pool.free for w in g.ranks)
        total = sum(w.total_blocks for w in g.ranks)
        info = StepInfo(
            worker=g.ranks[0].index,
            start=now,
            duration=duration,
            num_seqs=sum(w.step_terms.seqs for w in g.ranks if w.step_terms is not None),
            num_tokens=sum(w.step_terms.tokens for w in g.ranks if w.step_terms is not None),
            kv_usage=used / total,
            flop_util=cost.compute / roof,
            bw_util=cost.memory / roof,
            preempted=preempted,
        )
        if self._accept is not None:
            info = self._with_drafts(info, counts, plain, g.ranks)
        return StepEvents(
            time=now, tokens=tuple(tokens), finished=tuple(finished), arrived=(), step=info
        )

    # ------------------------------------------------------------------ state
    def num_waiting(self) -> int:
        workers = self.workers
        if len(workers) == 1:
            return workers[0].waiting.count
        return sum(w.waiting.count for w in workers)

    def num_running(self) -> int:
        """Running requests (a group counts once; see ``statistics().running_seqs``)."""
        return sum(len(w.running) for w in self.workers)

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    def set_step_time_factor(self, factor: float) -> None:
        """Price every step that starts from now on at ``factor`` x its roofline time
        (``factor`` > 0; 1.0 restores). Steps in flight keep their end times."""
        if not 0 < factor < float("inf"):
            raise ValueError(f"step_time_factor must be a finite number > 0, got {factor}")
        self.step_time_factor = factor

    def set_max_num_seqs(self, n: int) -> None:
        """Change the per-worker cap; effective at the next admission. Never evicts."""
        if n < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {n}")
        self._max_num_seqs = n
        for w in self.workers:
            w.max_num_seqs = n

    @property
    def prefix_caching(self) -> bool:
        """Whether the deployment caches prefixes (``enable_prefix_caching``)."""
        return self.deployment.scheduler.enable_prefix_caching

    def take_kv_events(self) -> tuple[KVEvent, ...]:
        """The KV-cache events recorded since the last call, in the order they happened
        (blocks stored, evicted, all cleared; each names its worker), and forget them.
        Empty unless the engine was built with ``record_kv_events=True``."""
        events = self._kv_events
        if not events:
            return ()
        out = tuple(events)
        events.clear()
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block of every worker (as vLLM's ``reset_prefix_cache``): only
        when no running request holds one; returns whether it was done. Hit counters are
        kept."""
        if any(w.pool.held_cached_blocks for w in self.workers):
            return False
        for w in self.workers:
            w.pool.clear()
        return True

    def statistics(self) -> EngineStatistics:
        return engine_statistics(
            now=self.now,
            pending_arrivals=self._pending,
            preemptions=self._preemptions,
            steps=self._steps,
            finished=self._finished,
            aborted=self._aborted,
            max_num_seqs=self._max_num_seqs,
            workers=tuple(w.statistics() for w in self.workers),
            prefix_caching=self.prefix_caching,
        )
