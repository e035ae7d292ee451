"""The engine's event loop: arrivals and step boundaries handled in time order.

This is the engine's half that moves time (:class:`EventLoop`, the base of
:class:`~inference_lab.core.engine.engine.Engine`, whose other half is its API): it pops
the calendar's events, hands arrivals to their workers, ends each step in flight and
starts the next one, priced by the roofline.

Rule 1: a step's batch is chosen at its start time and its tokens and completions happen at
        its end time: both are returned by the one ``step()`` call that handles the event at
        that time (the step boundary), which also chooses the next batch. So an arrival
        stamped before a boundary joins the batch that starts at that boundary -- also when
        it reaches the engine after that boundary was handled (a paced caller hands arrivals
        over with a delay): if the step in flight started after the arrival's stamp
        and nothing else is waiting, the arrival joins it when the step has room (cap,
        token budget, blocks), and the step is priced again with it (its end moves later;
        the ``StepInfo`` reported at its start is not revised).
Rule 2: :meth:`EventLoop.run_until` handles the events before a time exactly as as many
        ``step()`` calls would, in the same order, leaving the same state; instead of a
        ``StepEvents`` each it writes each started step's figures to a step log and each
        completion to a list. A worker's pure decode steps (every running request
        decoding, none finishing, nothing waiting, the new blocks free) are handled there
        as one run by the fast path (:meth:`FastPath.decode_run`), with each step's
        duration, start and figures those the boundaries one at a time give, to the bit.
"""

from __future__ import annotations

import attrs

from inference_lab.core.config import Deployment, transfer_seconds
from inference_lab.core.engine.block_pool import KVEvent
from inference_lab.core.engine.calendar import (
    ARRIVAL,
    BOUNDARY,
    GROUP_BOUNDARY,
    TRANSFER,
    EventCalendar,
)
from inference_lab.core.engine.dp_group import DPGroup
from inference_lab.core.engine.drafting import (
    DraftCounts,
    draft,
    plain_equivalent,
    price_lockstep,
    price_step,
)
from inference_lab.core.engine.fast_path import FastBatch
from inference_lab.core.engine.handoff import Handoffs
from inference_lab.core.engine.outputs import (
    Finished,
    StepEvents,
    StepInfo,
    step_events,
    step_info,
)
from inference_lab.core.engine.request import WAITING, Request
from inference_lab.core.engine.router import Router
from inference_lab.core.engine.runs import RunLoop, RunReport, Started
from inference_lab.core.engine.scheduler import Scheduler
from inference_lab.core.roofline import Roofline, StepCost
from inference_lab.core.speculative import AcceptanceDraws, RateAcceptance

__all__ = ["EventLoop", "RunReport"]  # (RunReport: runs.py, re-exported)


class EventLoop(RunLoop):
    """The engine's event handling (Rules 1 and 2): its workers, their lockstep groups, the
    calendar, the speculative draws and the counters it keeps."""

    #: Every step lasts this many times its roofline time (the test harness's slowdown).
    step_time_factor = 1.0

    def __init__(
        self,
        deployment: Deployment,
        *,
        record_kv_events: bool,
        acceptance: AcceptanceDraws | None,
    ) -> None:
        self.deployment = deployment
        self._kv_events: list[KVEvent] | None = [] if record_kv_events else None
        split = deployment.disaggregation
        #: the hand-offs between a disaggregated deployment's pools (None: aggregated)
        self._handoffs = None if split is None else Handoffs(split)
        #: a disaggregated deployment's prefill and decode workers (None: aggregated)
        self._pools: tuple[list[Scheduler], list[Scheduler]] | None = None
        self._make_workers(deployment)
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
        self._requests: dict[int, Request] = {}
        self._router = Router(
            hw.router, hw.affinity_load_ratio, hw.kv_aware_queue_weight, hw.router_seed
        )
        self._decode_router = self._router
        if split is not None:
            p = split.prefill.hardware
            self._router = Router(
                split.prefill_router,
                p.affinity_load_ratio,
                p.kv_aware_queue_weight,
                p.router_seed,
            )
            self._decode_router = Router(split.decode_router, 1.0, 0.0)
        #: KV transfers from a remote prefill started: count, bytes, seconds
        self._transfer_count = 0
        self._transfer_bytes = 0.0
        self._transfer_seconds = 0.0
        self._pending = 0
        self._preemptions = 0
        self._steps = 0
        self._finished = 0
        #: seconds from a request's arrival to its entering the engine (engine Rule 7)
        self._frontend = deployment.scheduler.frontend_latency
        #: the tokens ``run_until`` has a step end emit (nobody reads them there)
        self._scratch: list[tuple[int, int]] = []
        #: the requests a decode run ended, with their finish times
        self._ended: list[tuple[Request, float, float]] = []
        #: the requests whose remote prefill's KV arrived since the caller last took them
        #: (:meth:`Engine.take_kv_arrived`: a decode server's, without ``[disaggregation]``)
        self._kv_arrived: list[int] = []

    def _make_workers(self, deployment: Deployment) -> None:
        """The deployment's workers and the roofline that prices its steps (a
        disaggregated deployment's: its decode pool's; its prefill pool comes first)."""
        split = deployment.disaggregation
        if split is None:
            self.roofline = Roofline(deployment)
            self.workers = [
                Scheduler(i, deployment, self.roofline, self._kv_events)
                for i in range(deployment.workers)
            ]
            return
        self.roofline = Roofline(split.decode)
        prefill_rf = Roofline(split.prefill)
        first = split.prefill.workers
        self.workers = [
            Scheduler(i, split.prefill, prefill_rf, self._kv_events) for i in range(first)
        ] + [
            Scheduler(first + i, split.decode, self.roofline, self._kv_events)
            for i in range(split.decode.workers)
        ]
        for w in self.workers[:first]:
            w.internal = True
        self._pools = (self.workers[:first], self.workers[first:])

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
        if kind == TRANSFER:
            self._received(payload, now)
            return step_events(now, (), (), (), None)
        return self._boundary(payload, now)

    def _arrive(self, r: Request, now: float) -> None:
        """The arrival of ``r`` at ``now``: it enters its worker's waiting queue, which
        steps at ``now`` if idle (or takes it into the step in flight: Rule 2)."""
        self._pending -= 1
        hint = r.routed_worker
        workers = self.workers
        if self._pools is not None:  # a prefill request to the prefill pool (handoff Rule 1)
            if r.hold_kv:
                w = self._router.choose(self._pools[0], r)
            else:
                w = self._decode_router.choose(self._pools[1], r)
        elif hint is not None:
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
        if w.lora is not None and not w.lora.may_join(r, w.running):
            return
        g = self._group_of[w.index]
        start = w.step_start if g is None else g.step_start
        terms = w.terms_in_flight()  # (before the admission: a decode run's are lazy)
        admitted = w.admit_head(start, w.step_mark, w.step_budget)
        if w.new_transfers:
            self._file_transfers(w, start)
        if admitted is None:
            return
        _, n = admitted
        r.arrival_time = r.stamped_time  # it is treated as having arrived when stamped
        w.batch.append(admitted)
        rf = w.roofline
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
                rank.busy_seconds += end - rank.step_end  # (the step's end moved)
                rank.step_end = end
            self._calendar.file_boundary(g, end, GROUP_BOUNDARY)
            return
        cost = rf.price(terms) if w.step_plain is None else price_step(rf, w)[0]
        if w.lora is not None:
            cost = w.lora.again(cost, w.batch)
        end = w.step_start + cost.seconds * self.step_time_factor
        w.busy_seconds += end - w.step_end  # (the step's end moved)
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
            self._ended_request(w, r, now, w.step_end - w.step_start, finished)
        return head

    def _ended_request(
        self, w: Scheduler, r: Request, now: float, step: float, finished: list[Finished]
    ) -> None:
        """``r`` ended on ``w`` at ``now`` (its last step took ``step`` s): its
        ``Finished``, or with disaggregation the hand-off of its prefill (handoff Rules
        1-4)."""
        handoffs = self._handoffs
        if handoffs is None:
            del self._requests[r.id]
            self._finished += 1
            record = self._record
            if record is not None:  # (a run's recorder: its fields, no Finished)
                record(r.finished_fields(now, w.index, self._frontend))
            else:
                finished.append(r.report(now, w.index, self._frontend))
            return
        if not w.internal:
            del self._requests[r.id]
            self._finished += 1
            finished.append(handoffs.report(r, now, w.index, self._frontend))
            return
        spec, at = handoffs.prefill_done(w, r, now, step)
        decode = Request(
            r.id, spec, at, spec.max_tokens if spec.target is None else spec.target, at
        )
        self._pools[1][0].kv.prepare(decode)  # type: ignore[index]  # (pools: disaggregated)
        self._requests[r.id] = decode
        self._pending += 1
        self._calendar.file_arrival(decode, at)
        if not spec.remote_positions:  # nothing to send: its blocks go back now
            held = handoffs.transfer_done(decode, now)
            if held is not None:
                self._release(held, now)

    def _file_transfers(self, w: Scheduler, now: float) -> None:
        """The receptions ``w``'s last pass started (scheduler Rule 6): each transfer's end
        filed, priced by the link (handoff Rule 3)."""
        for r in w.new_transfers:
            if r.tier_fetch is not None:  # from the KV tiers behind HBM (kv_tiers Rule 3)
                assert w.tiers is not None
                _, seconds = w.tiers.fetched(r)
                self._calendar.file_transfer(r, now + seconds)
                continue
            if self._handoffs is not None:
                sent, seconds = self._handoffs.transfer(r)
            else:
                sent, seconds = self._own_transfer(w, r)
            self._transfer_count += 1
            self._transfer_bytes += sent
            self._transfer_seconds += seconds
            self._calendar.file_transfer(r, now + seconds)
        w.new_transfers.clear()

    def _own_transfer(self, w: Scheduler, r: Request) -> tuple[float, float]:
        """A decode server's reception (no ``[disaggregation]``): the bytes of ``r``'s
        remote positions it has not cached, over the profile's scale-out link (NVLink
        without one) on ``tp`` GPU links at once."""
        dep = self.deployment
        sent = dep.kv_bytes_of(r.remote_positions) - dep.kv_bytes_of(r.num_computed)
        fabric = dep.profile.fabric
        if fabric is None:
            return sent, 0.0
        link = fabric.scale_out if fabric.scale_out is not None else fabric.scale_up
        layers = dep.model.num_layers
        return sent, transfer_seconds(
            link, dep.hardware.tp, sent, overlap=False, layers=layers, overlapped=0.0
        )

    def _release(self, held: Request, now: float) -> None:
        """``held``'s blocks go back (scheduler Rule 6); its worker, idle with requests
        waiting for blocks, steps at ``now``."""
        w = self.workers[held.worker]
        w.release(held)
        if w.waiting.count and not w.scheduled:
            w.scheduled = True
            self._calendar.file_boundary(w, now, BOUNDARY)

    def _received(self, r: Request, now: float) -> None:
        """``r``'s remote KV arrived at ``now`` (scheduler Rule 6): it is admitted next on
        its worker, and a prefill's held blocks go back (handoff Rule 3)."""
        w = self.workers[r.worker]
        w.received(r)
        if self._handoffs is not None:
            held = self._handoffs.transfer_done(r, now)
            if held is not None:
                self._release(held, now)
        else:
            self._kv_arrived.append(r.id)
        if not w.scheduled:
            w.scheduled = True
            self._calendar.file_boundary(w, now, BOUNDARY)

    def _boundary(self, w: Scheduler, now: float) -> StepEvents:
        """The step of ``w`` ends at ``now``: complete it, then choose, price and file its
        next one (none: the worker idles until an arrival)."""
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        head = self._complete(w, now, tokens, finished)
        started = self._start_step(w, now)
        info = None if started is None else self._step_info(w, now, started)
        emitted = head + tuple(tokens) if tokens else head if head else ()
        if w.internal:
            emitted = ()  # a prefill pool's tokens are not the client's (handoff Rule 1)
        return step_events(now, emitted, tuple(finished) if finished else (), (), info)

    def _start_step(self, w: Scheduler, now: float) -> Started | None:
        """Choose ``w``'s next batch at ``now``, price it and file its end; None when it
        has nothing to run (it idles until an arrival)."""
        out = w.schedule(now)
        if w.new_transfers:
            self._file_transfers(w, now)
        batch = out.batch
        preempted = out.preempted
        self._preemptions += preempted
        if not (type(batch) is FastBatch or batch):  # (a FastBatch is never empty)
            w.batch = []
            w.scheduled = False
            return None
        rf = w.roofline
        counts = None
        if self._accept is None:
            terms = out.terms
            if terms is None:
                assert out.positions is not None and out.contexts is not None
                terms = rf.batch_terms(out.positions, out.contexts)
            cost = plain = rf.price(terms)
            if w.lora is not None:  # adapter loads and kernels (lora Rules 2, 3)
                cost = plain = w.lora.price(cost, batch)
            w.step_terms = terms
        else:
            assert isinstance(batch, list)  # (speculation keeps the fast path off)
            counts = draft(rf, self._accept, w, batch)
            cost, plain = price_step(rf, w)
            assert w.step_terms is not None  # set by draft
            terms = w.step_terms
        duration = cost.seconds * self.step_time_factor
        end = now + duration
        w.busy_seconds += duration
        w.batch = batch
        w.step_start = now
        w.step_end = end
        self._calendar.file_boundary(w, end, BOUNDARY)
        self._steps += 1
        return cost, terms, preempted, counts, plain

    def _step_info(self, w: Scheduler, now: float, started: Started) -> StepInfo:
        """The ``StepInfo`` of the step ``_start_step`` started on ``w`` at ``now``."""
        cost, terms, preempted, counts, plain = started
        roof = cost.roofline if cost.roofline > 0 else 1.0
        info = step_info(
            worker=w.index,
            start=now,
            duration=cost.seconds * self.step_time_factor,
            num_seqs=terms.seqs,
            num_tokens=terms.tokens,
            kv_usage=(w.total_blocks - w.pool.free) / w.total_blocks,
            flop_util=cost.compute / roof,
            bw_util=cost.memory / roof,
            preempted=preempted,
        )
        if counts is not None:
            info = self._with_drafts(info, counts, plain, [w])
        return info

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
        for w in g.ranks:
            w.busy_seconds += duration
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
