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
Rule 8: ``submit_plain`` is ``submit`` of a spec with a prompt, a length and an arrival
        time only (every other field its default: the simulator's open loop) without the
        spec object: the same request, built from :data:`PLAIN_SPEC` with its two
        lengths set, filed the same way; anything that may be refused or is malformed
        goes through ``submit``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from inference_lab.core.config import Deployment
from inference_lab.core.engine.block_pool import KVEvent
from inference_lab.core.engine.limits import check_fits, fits_total
from inference_lab.core.engine.lora import Adapter, AdapterSet, LoraSlots, adapter_hashes
from inference_lab.core.engine.outputs import (
    EngineStatistics,
    QueueView,
    engine_statistics,
)
from inference_lab.core.engine.request import (
    DONE,
    PENDING,
    RECEIVING,
    RUNNING,
    WAITING,
    Request,
    RequestSpec,
)
from inference_lab.core.engine.stepping import EventLoop
from inference_lab.core.speculative import AcceptanceDraws, expected_length
from inference_lab.errors import RequestRefused

#: Rule 8: a spec of every default field, whose request takes the lengths it is given
PLAIN_SPEC = RequestSpec(prompt_tokens=1, max_tokens=1)

__all__ = ["Engine"]


class Engine(EventLoop):
    """One deployment: ``replicas`` workers behind a router (``replicas * dp_attention``
    with data-parallel attention ranks), and the event calendar. Its event handling is
    its base's (:class:`~inference_lab.core.engine.stepping.EventLoop`: ``step``,
    ``run_until``); this class is the rest of its API.

    Called by ``inference-lab sim`` (as fast as the CPU allows) and by the serve runtime's
    engine task (paced to wall-clock). Not thread-safe; every method is synchronous.
    ``acceptance`` replaces the speculative decoding draws of ``[speculative]`` (a seeded
    :class:`~inference_lab.core.speculative.RateAcceptance`) with the caller's.
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        record_kv_events: bool = False,
        acceptance: AcceptanceDraws | None = None,
    ) -> None:
        super().__init__(deployment, record_kv_events=record_kv_events, acceptance=acceptance)
        self._ids = itertools.count(1)
        #: the LoRA adapters served (None: no [lora]; lora Rules 1-5)
        self.adapters: AdapterSet | None = None
        if deployment.lora is not None:
            self.adapters = AdapterSet(deployment.lora)
            for w in self.workers:
                w.lora = LoraSlots(deployment, self.adapters, w.roofline.bandwidth)
        self._aborted = 0
        self._max_num_seqs = deployment.scheduler.max_num_seqs
        #: a plain request of at most this many positions passes every check of check_fits
        split = deployment.disaggregation
        self._fits_total = (
            fits_total(deployment, self.roofline)
            if split is None
            else min(
                fits_total(split.decode, self.roofline),
                fits_total(split.prefill, self.workers[0].roofline),
            )
        )

    # ------------------------------------------------------------------ admission
    def check_fits(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> RequestRefused | None:
        """Why a request of this size (``n`` sequences sharing the prompt) can never run
        here, or None (:func:`~inference_lab.core.engine.limits.check_fits`). Pure: the
        serving layer calls it before admission to answer 400
        ``context_length_exceeded``. With disaggregation, its prompt on the prefill pool
        and the whole of it on the decode pool."""
        split = self.deployment.disaggregation
        if split is None:
            return check_fits(self.deployment, self.workers[0].kv, prompt_tokens, max_tokens, n)
        assert self._pools is not None
        refused = check_fits(split.decode, self._pools[1][0].kv, prompt_tokens, max_tokens, n)
        if refused is None:
            refused = check_fits(split.prefill, self._pools[0][0].kv, prompt_tokens, 1, n)
        return refused

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
        if spec.remote_positions and not (
            spec.n == 1 and 0 <= spec.remote_positions < spec.prompt_tokens
        ):
            raise ValueError("remote_positions needs n = 1 and fewer positions than the prompt")
        if spec.n != 1 or spec.prompt_tokens + spec.max_tokens > self._fits_total:
            refused = self.check_fits(spec.prompt_tokens, spec.max_tokens, spec.n)
            if refused is not None:
                raise refused
        rid = next(self._ids)
        stamp = spec.arrival_time + self._frontend if self._frontend else spec.arrival_time
        arrival = stamp if stamp > self.now else self.now
        if self._handoffs is not None:  # its prefill request first (handoff Rule 1)
            if spec.n != 1 or spec.hold_kv or spec.remote_positions:
                raise ValueError("with disaggregation a request has n = 1 and no remote KV")
            spec = self._handoffs.prefill_spec(rid, spec)
            target = 1
        r = Request(rid, spec, arrival, target, stamp)
        if spec.lora is not None:
            self._with_adapter(r, spec.lora)
        return self._file(r, arrival, preorder)

    def submit_plain(
        self, prompt_tokens: int, max_tokens: int, arrival_time: float, preorder: int
    ) -> int:
        """``submit(RequestSpec(prompt_tokens=..., max_tokens=..., arrival_time=...),
        preorder=...)`` without the spec (Rule 8: the simulator's feed of an open loop): the
        same request, filed the same way, and the same answer (an id, RequestRefused or
        ValueError) -- a request that could be refused or is malformed, or an engine with
        hand-offs, goes through :meth:`submit` itself."""
        if (
            prompt_tokens < 1
            or max_tokens < 1
            or prompt_tokens + max_tokens > self._fits_total
            or self._handoffs is not None
        ):
            spec = RequestSpec(
                prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival_time=arrival_time
            )
            return self.submit(spec, preorder=preorder)
        rid = next(self._ids)
        stamp = arrival_time + self._frontend if self._frontend else arrival_time
        arrival = stamp if stamp > self.now else self.now
        r = Request(rid, PLAIN_SPEC, arrival, max_tokens, stamp)
        r.prompt_tokens = prompt_tokens
        r.max_tokens = max_tokens
        # (_file: without block hashes, KVCacheManager.prepare leaves the fields as made)
        self._requests[rid] = r
        self._pending += 1
        self._calendar.file_arrival(r, arrival, preorder)
        return rid

    def _file(self, r: Request, arrival: float, preorder: int | None) -> int:
        """The new request ``r`` prepared for the prefix cache, known and filed to arrive
        at ``arrival`` (with ``preorder``: Rule 6); its id."""
        self.workers[0].kv.prepare(r)  # the same answer on every worker
        self._requests[r.id] = r
        self._pending += 1
        self._calendar.file_arrival(r, arrival, preorder)
        return r.id

    def _with_adapter(self, r: Request, name: str) -> None:
        """``r`` runs with the adapter ``name``: its id, name and own block hashes (lora
        Rule 4). ValueError when no such adapter was ever served (the serving layer refuses
        a name not served; one unloaded after its request was admitted still runs)."""
        adapter = None if self.adapters is None else self.adapters.resolve(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        r.lora = adapter.id
        r.lora_name = name
        if r.block_hashes:
            r.block_hashes = adapter_hashes(r.block_hashes, name)

    def load_adapter(
        self, name: str, path: str, rank: int = 0, parent: str | None = None
    ) -> Adapter:
        """Serve a new adapter (vLLM's ``add_lora``: into every worker's host cache,
        evicting the least recently used there). ValueError without ``[lora]``, for a
        name served already or a rank past ``max_lora_rank``."""
        if self.adapters is None:
            raise ValueError("LoRA is not enabled")
        adapter = self.adapters.add(name, path, rank, parent)
        for w in self.workers:
            assert w.lora is not None
            w.lora.added(adapter)
        return adapter

    def unload_adapter(self, name: str) -> Adapter:
        """Stop serving ``name`` (it leaves ``adapters.by_name``); requests naming it run
        to their end (vLLM's ``/v1/unload_lora_adapter``, which refuses nothing in use).
        KeyError when it is not served."""
        if self.adapters is None:
            raise KeyError(name)
        return self.adapters.remove(name)

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
        elif r.status == RECEIVING:  # its transfer's end goes stale
            w = self.workers[r.worker]
            w.receiving.remove(r)
            w.kv.free(r)
        r.status = DONE
        if self._handoffs is not None:  # a held prefill goes too (handoff Rule 5)
            held = self._handoffs.abort(request_id)
            if held is not None:
                self._release(held, self.now)
        self._aborted += 1
        return True

    def release_kv(self, request_id: int) -> bool:
        """Give back the blocks a finished request held for a remote decode (``hold_kv``:
        a prefill server's ``do_remote_decode``, once pulled or expired); False when no
        worker holds them."""
        for w in self.workers:
            held = w.held.get(request_id)
            if held is not None:
                self._release(held, self.now)
                return True
        return False

    def take_kv_arrived(self) -> tuple[int, ...]:
        """The ids of the requests whose remote prefill's KV arrived (``remote_positions``
        received, the request back in its queue) since the last call, in the order they
        arrived, and forget them. For a decode server, which tells the prefill server the
        KV was pulled; always empty with ``[disaggregation]`` (its hand-offs release the
        prefill's blocks themselves)."""
        arrived = self._kv_arrived
        if not arrived:
            return ()
        out = tuple(arrived)
        arrived.clear()
        return out

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
        if spec.lora is not None:
            self._with_adapter(r, spec.lora)
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

    # ------------------------------------------------------------------ state
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
            transfers=(self._transfer_count, self._transfer_bytes, self._transfer_seconds),
        )
