"""The engine core: requests, KV blocks, the scheduler, the event heap.

A pure discrete-event simulation with the h11 shape: ``submit``, ``abort``,
``next_event_time``, ``step``, ``statistics``; outputs are frozen event objects. It drives
both ``inference-lab sim`` (as fast as the CPU allows) and the serve runtime (paced to
wall-clock).

A request is a **group** of ``n`` sequences (``n`` choices of one prompt; ``n = 1`` is a
plain request), modelled on vLLM's parallel sampling with prefix sharing. The prompt is
prefilled once, as one sequence, and its KV blocks are shared; the pass that completes it
emits token 1 of every sequence. From then on the ``n`` sequences decode together: each is
a batch member (one position, priced by the roofline like any other request) and counts
toward ``max_num_seqs``; each holds its own copy of the prompt's last, partly filled
block and its own output blocks (and its own private blocks: windowed KV, recurrent
state). All sequences of a group advance in the same steps, so a group reports one token
count per step and one ``Finished`` for all its choices (``output_tokens`` per choice).

Rule 1: no trio, quart, hypercorn, ``time`` or global ``random``: time is a number of
        simulated seconds passed in and out (a test walks this module's imports).
Rule 2: a step's batch is chosen at its start time and its tokens and completions happen at
        its end time: both are returned by the one ``step()`` call that handles the event at
        that time (the step boundary), which also chooses the next batch. So an arrival
        stamped before a boundary joins the batch that starts at that boundary — also when
        it reaches the engine after that boundary was handled (a paced caller hands arrivals
        over with a delay): if the step in flight started after the arrival's stamp
        and nothing else is waiting, the arrival joins it when the step has room (cap,
        token budget, blocks), and the step is priced again with it (its end moves later;
        the ``StepInfo`` reported at its start is not revised).
Rule 3: a plain request computes ``P + target - 1`` positions in all; the prefill pass
        emits token 1; a preempted request re-prefills ``P + output - 1`` positions
        emitting nothing, then decodes on. A group computes ``P + n * (target - 1)``: the
        prompt once, then ``n`` positions per decode step; after a preemption it
        re-prefills the prompt once (one sequence), then each sequence's ``output - 1``
        positions (``n`` sequences of equal chunks), emitting nothing, then decodes on.
Rule 4: KV blocks are conserved: a worker's free blocks plus the blocks held by its
        running requests always equal its total, whatever is finished, preempted or
        aborted. A group holding ``c`` positions per sequence holds ``blocks_for(c)`` while
        ``c <= P`` and ``s + n * (blocks_for(c) - s)`` after, where ``s = P // block_size``
        is the number of full prompt blocks its sequences share.
Rule 5: ``max_num_seqs`` caps the running *sequences* and gates admission only: lowering
        it drains, it never evicts. A group is admitted when its ``n`` sequences fit under
        the cap, or when its worker runs nothing at all (so a group wider than the cap
        runs alone instead of waiting forever).
Rule 6: a group is one request to the scheduler: admitted, preempted, aborted and finished
        as a unit (its blocks are freed together); ``step()`` reports its tokens once per
        step as the count each of its sequences emitted.
Rule 7: the KV cache is asked, never kept, here (:mod:`inference_lab.core.kv_cache`). With
        prefix caching on, a request carrying block hashes is admitted with the prefix
        its worker has cached already: those positions count as computed (no FLOPs, no
        step tokens) while attention still reads them (the roofline sees them as the
        context ``c`` of its first chunk). A request without hashes, or prefix caching
        off, is scheduled exactly as if the cache did not exist.
Rule 8: with ``[speculative]``, a decoding sequence's step computes its verify width ``1 +
        gamma`` positions (gamma capped so that it never passes ``max_tokens``, and by the
        step's token budget) and reserves their KV blocks and budget; when its step ends
        it advances by ``1 + accepted`` positions and tokens, capped by its remaining
        length, the accepted count drawn when the batch is chosen from the engine's own
        seeded draws (:mod:`inference_lab.core.speculative`; a group draws once for its
        sequences). The blocks of rejected positions stay held until the request ends,
        is preempted or aborted; prefill chunks and a step's admissions never draft.
Rule 9: with ``dp_attention`` ranks, each rank is a worker (its own scheduler, waiting
        queue and KV blocks) and a replica's ranks step in lockstep: one boundary ends the
        step of all of them and starts their next batches together, priced as one step
        (the slowest rank's part and the shared experts' part: the roofline's Rule 6).
Rule 10: a worker running at least ``VECTOR_MIN`` plain requests, without speculative
        decoding and with no block being cached or evictable, keeps its decoding ones
        lazily (a decode counter and calendars of their events:
        :mod:`inference_lab.core.running_rows`) and chooses and completes a step that
        takes every running request whole in O(1) plus the step's events and its other
        rows; any other step (a budget or free blocks too small for all, a group, a
        preemption, an abort) leaves that mode first. Both ways produce the same events,
        to the bit.
Rule 11: events at the same time are handled in the order they were filed; an arrival
        submitted with ``preorder`` is filed as if it had been submitted before the first
        step, so an open loop fed to the engine lazily, in arrival order and never later
        than its arrival time, runs exactly as if every arrival had been submitted first.
Rule 12: ``frontend_latency`` (seconds, ``[scheduler]``) is what a real server's API
        process takes before its engine sees a request: a request submitted with
        ``arrival_time`` t is an arrival at ``t + frontend_latency`` to everything here
        (its event, its stamp for Rule 2), while the ``Finished`` it ends with reports
        ``arrival_time`` t, so its TTFT, queue time and E2E include the latency.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from inference_lab.core.builders import frozen_builder
from inference_lab.core.config import Deployment
from inference_lab.core.kv_cache import NOT_CACHED, BlockPool, KVCacheManager, KVEvent
from inference_lab.core.roofline import BatchTerms, Roofline, StepCost
from inference_lab.core.running_rows import RunningRows
from inference_lab.core.speculative import AcceptanceDraws, RateAcceptance, expected_length
from inference_lab.errors import RequestRefused

_PENDING, _WAITING, _RUNNING, _DONE = 0, 1, 2, 3
#: A worker enters the vectorised mode (Rule 10) when it runs at least this many plain
#: requests, and leaves it when it runs fewer than half as many: a small batch gains
#: little from it, and entering it costs a pass over the rows.
VECTOR_MIN = 32
_ARRIVAL, _BOUNDARY, _GROUP_BOUNDARY = 0, 1, 2
#: Heap sequence numbers of arrivals submitted with ``preorder`` start here: below every
#: number the engine's own counter gives (Rule 11).
_PREORDER = 1 << 62


@attrs.frozen
class RequestSpec:
    """What the caller asks for. ``target`` is where each sequence really stops (hidden
    from the scheduler); None means it runs to ``max_tokens``. ``n`` is the number of
    sequences (choices) sharing the prompt. ``worker`` is the replica the caller already
    routed it to (:meth:`Engine.route`); None lets the router choose when it arrives.

    ``block_hashes`` is the request's hash chain at the deployment's block size: hash
    ``i`` stands for tokens ``[0, (i + 1) * block_size)`` and includes its parent's. It
    may run past the prompt over the tokens the request will produce (a session's next
    turn resends them); blocks are cached as their positions are computed. Empty: the
    request neither hits nor fills the prefix cache."""

    prompt_tokens: int
    max_tokens: int
    target: int | None = None
    priority: int = 0
    arrival_time: float = 0.0
    n: int = 1
    worker: int | None = None
    block_hashes: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class Finished:
    """A completed request, reported at its finish time (the end of its last step).

    ``output_tokens`` is the count of each of its ``n`` sequences (they finish together);
    the request produced ``n * output_tokens`` tokens in all. ``cached_tokens`` is the
    prompt prefix its worker had cached when it was first admitted (not computed by
    it); ``worker`` the replica that ran it.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    preemptions: int
    n: int = 1
    cached_tokens: int = 0
    worker: int = 0


@attrs.frozen(kw_only=True)
class StepInfo:
    """The batch that started at a boundary on one worker.

    ``num_seqs`` counts sequences in the batch (a group's shared prefill is one, its
    decode ``n``); ``num_tokens`` the positions computed; ``kv_usage`` the worker's used
    fraction of KV blocks after the batch was chosen; ``flop_util`` / ``bw_util`` the
    compute and memory parts of the step's roofline time; ``preempted`` how many requests
    were preempted to make room. A lockstep step of data-parallel attention ranks is one
    ``StepInfo`` (``worker`` its first rank; sums over the ranks; ``kv_usage`` over their
    blocks).

    With speculative decoding: ``drafts`` the sequences that verified draft tokens,
    ``draft_tokens`` those tokens, ``accepted_tokens`` the accepted ones and
    ``accepted_per_position`` how many drafts accepted position ``j`` (vLLM's counters);
    ``plain_duration`` how long the step's tokens would take without speculation: the
    same batch without drafts (no verify width, no drafter), then ``accepted_tokens /
    drafts`` more steps of one position per drafting sequence -- the speed-up
    estimate's reference. All 0 / empty otherwise.
    """

    worker: int
    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    kv_usage: float
    flop_util: float
    bw_util: float
    preempted: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    plain_duration: float = 0.0


@attrs.frozen(kw_only=True)
class StepEvents:
    """What became visible at ``time``: tokens emitted (request id, count; a group's count
    is what each of its sequences emitted), completions (their last token is in
    ``tokens``), arrivals that entered a worker's waiting queue, and the batch that
    started (None if none did)."""

    time: float
    tokens: tuple[tuple[int, int], ...]
    finished: tuple[Finished, ...]
    arrived: tuple[int, ...]
    step: StepInfo | None


# positional constructors of the records built every step / request (:mod:`builders`)
_step_events = frozen_builder(StepEvents)
_step_info = frozen_builder(StepInfo)
_finished = frozen_builder(Finished)


@attrs.frozen(kw_only=True)
class WorkerStatistics:
    """A snapshot of one worker (replica), from :meth:`Engine.statistics`.

    Attributes:
      waiting: requests in the worker's waiting queue (preempted ones included).
      running: requests (groups) admitted and not finished, preempted or aborted.
      running_seqs: their sequences, the number ``max_num_seqs`` caps.
      kv_used_blocks: KV blocks held by the running requests.
      kv_total_blocks: KV blocks of the replica.
      max_num_seqs: the current cap on running sequences.
      prefix_cache_queries: tokens looked up in the prefix cache at admissions.
      prefix_cache_hits: of them, tokens found cached (not computed).
      cached_blocks: blocks holding a known prefix, held or evictable (evictable ones
        count as free, not used).
    """

    waiting: int
    running: int
    running_seqs: int
    kv_used_blocks: int
    kv_total_blocks: int
    max_num_seqs: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_blocks: int = 0


@attrs.frozen(kw_only=True)
class QueueView:
    """One worker as its admission sees it, from :meth:`Engine.queue_views`.

    Attributes:
      running_seqs: running sequences.
      max_num_seqs: the cap on running sequences in force.
      free_blocks: free KV blocks.
      queued: per queued request, in the order the scheduler admits them: its sequences
        and the blocks its first prefill chunk takes when admitted.
    """

    running_seqs: int
    max_num_seqs: int
    free_blocks: int
    queued: tuple[tuple[int, int], ...]


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot of the whole engine, from :meth:`Engine.statistics`.

    Attributes:
      now: the simulated time, in seconds.
      pending_arrivals: requests submitted whose arrival no ``step()`` has handled yet.
      waiting: requests in the workers' waiting queues (sum over workers).
      running: requests (groups) running on the workers.
      running_seqs: their sequences.
      kv_used_blocks: KV blocks held, over all workers.
      kv_total_blocks: KV blocks of all workers.
      kv_usage: ``kv_used_blocks / kv_total_blocks`` (0.0 without blocks).
      preemptions: preemptions since the engine was built.
      steps: batches run since the engine was built, over all workers.
      finished: requests that completed.
      aborted: requests removed by :meth:`Engine.abort`.
      max_num_seqs: the current per-worker cap on running sequences.
      workers: one :class:`WorkerStatistics` per worker, in worker order.
      prefix_caching: whether the deployment caches prefixes.
      prefix_cache_queries, prefix_cache_hits, cached_blocks: sums over workers.
    """

    now: float
    pending_arrivals: int
    waiting: int
    running: int
    running_seqs: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_usage: float
    preemptions: int
    steps: int
    finished: int
    aborted: int
    max_num_seqs: int
    workers: tuple[WorkerStatistics, ...]
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_blocks: int = 0


class _Request:
    __slots__ = (
        "id",
        "prompt",
        "max_tokens",
        "target",
        "priority",
        "arrival",
        "computed",
        "output",
        "first_token_time",
        "first_scheduled",
        "preemptions",
        "blocks",
        "room",
        "state",
        "worker",
        "mark",
        "admit_seq",
        "queue_key",
        "stamp",
        "n",
        "hint",
        "hashes",
        "hash_limit",
        "held",
        "cache_at",
        "cached",
        "lazy",
    )

    def __init__(
        self, rid: int, spec: RequestSpec, arrival: float, target: int, stamp: float
    ) -> None:
        self.id = rid
        self.n = spec.n
        self.prompt = spec.prompt_tokens
        self.max_tokens = spec.max_tokens
        self.target = target
        self.priority = spec.priority
        self.arrival = arrival
        # the caller's arrival time plus the frontend latency (may precede ``arrival``)
        self.stamp = stamp
        self.hint = spec.worker  # the worker the caller routed it to, if it did
        self.computed = 0
        self.output = 0
        self.first_token_time = -1.0
        self.first_scheduled = -1.0
        self.preemptions = 0
        self.blocks = 0
        self.room = 0  # positions its blocks surely hold (a plain request; 0: ask)
        self.state = _PENDING
        self.worker = -1
        self.mark = -1  # the step id whose batch holds this request
        self.admit_seq = 0
        self.queue_key: tuple[Any, ...] = ()
        self.hashes = spec.block_hashes
        # set by KVCacheManager.prepare when the request is routed
        self.hash_limit = 0
        self.held: list[int] | tuple[int, ...] = ()
        self.cache_at = NOT_CACHED
        self.cached = 0
        self.lazy = 0  # decoding in the vectorised mode: computed - the decode counter


class _WaitQueue:
    """The waiting queue of one worker. Preempted requests go to the front; otherwise the
    policy picks: ``fcfs`` head of queue (O(1) deque), the others a heap keyed by policy
    with lazy deletion. ``len`` is exact at all times."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.front: deque[_Request] = deque()
        self.fifo: deque[_Request] = deque()
        self.heap: list[tuple[Any, ...]] = []
        self.removed: set[int] = set()
        self.count = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self.count

    def push(self, r: _Request) -> None:
        self.count += 1
        if self.policy == "fcfs":
            self.fifo.append(r)
            return
        if self.policy == "priority":
            key: tuple[Any, ...] = (r.priority, r.arrival)
        elif self.policy == "sjf":
            key = (r.max_tokens, r.arrival)
        else:  # ljf
            key = (-r.max_tokens, r.arrival)
        r.queue_key = (*key, next(self._seq))
        heapq.heappush(self.heap, (*r.queue_key, r))

    def push_front(self, r: _Request) -> None:
        self.count += 1
        self.front.appendleft(r)

    def _clean_heap(self) -> None:
        heap = self.heap
        while heap and heap[0][-1].id in self.removed:
            self.removed.discard(heapq.heappop(heap)[-1].id)

    def peek(self) -> _Request | None:
        if self.front:
            return self.front[0]
        if self.policy == "fcfs":
            return self.fifo[0] if self.fifo else None
        self._clean_heap()
        return self.heap[0][-1] if self.heap else None

    def pop(self) -> _Request:
        self.count -= 1
        if self.front:
            return self.front.popleft()
        if self.policy == "fcfs":
            return self.fifo.popleft()
        self._clean_heap()
        r: _Request = heapq.heappop(self.heap)[-1]
        return r

    def __iter__(self) -> Iterator[_Request]:
        """Every waiting request (front first; a heap policy's in heap order)."""
        yield from self.front
        if self.policy == "fcfs":
            yield from self.fifo
        else:
            removed = self.removed
            yield from (e[-1] for e in self.heap if e[-1].id not in removed)

    def in_order(self) -> list[_Request]:
        """The queued requests in the order the scheduler admits them."""
        if self.policy == "fcfs":
            return [*self.front, *self.fifo]
        live = sorted(e for e in self.heap if e[-1].id not in self.removed)
        return [*self.front, *(e[-1] for e in live)]

    def remove(self, r: _Request) -> None:
        if r in self.front:
            self.front.remove(r)
        elif self.policy == "fcfs":
            self.fifo.remove(r)
        else:
            self.removed.add(r.id)
        self.count -= 1


class _Worker:
    """One replica: a scheduler with its own KV blocks and its in-flight batch."""

    def __init__(
        self, index: int, dep: Deployment, roofline: Roofline, events: list[KVEvent] | None
    ) -> None:
        sched = dep.scheduler
        self.index = index
        self.roofline = roofline
        self.total_blocks = roofline.total_blocks
        self.pool = BlockPool(self.total_blocks, index, events)
        self.kv = KVCacheManager(self.pool, sched.block_size, sched.enable_prefix_caching)
        self.max_num_seqs = sched.max_num_seqs
        self.budget = sched.max_num_batched_tokens
        self.chunked = sched.enable_chunked_prefill
        cap = sched.long_prefill_token_threshold
        self.chunk_cap = cap if (self.chunked and cap > 0) else 1 << 62
        self.policy = sched.policy
        self.block_size = sched.block_size
        self.private = roofline.has_private_blocks()
        self.waiting = _WaitQueue(sched.policy)
        self.running: list[_Request] = []
        self.running_seqs = 0  # sum of n over running
        self.batch: list[tuple[_Request, int]] = []
        self.scheduled = False  # a boundary event for this worker is in the heap
        self.boundary_seq = -1  # the heap sequence number of that event (older: stale)
        self.admit_seq = itertools.count()
        self.step_id = 0
        # The step in flight (when ``batch``): its start, its price's terms, the token
        # budget it left unused and its pass mark, so a late arrival can join it.
        self.step_start = 0.0
        self.step_end = 0.0
        self.step_terms: BatchTerms | None = None
        self.step_budget = 0
        self.step_mark = 0
        #: The lockstep group of its replica's data-parallel attention ranks (None: alone).
        self.group: _Group | None = None
        #: Speculative decoding (engine Rule 8): the config, and the step in flight's
        #: batch without drafts (its terms, widths, contexts), its drafting sequences'
        #: contexts and its draft length, which price it and a late arrival joining it.
        self.spec = dep.speculative
        self.step_plain: BatchTerms | None = None
        self.step_pns: list[int] = []
        self.step_cs: list[int] = []
        self.step_dcs: list[int] = []
        self.step_gamma = 0
        #: Rule 10: the vectorised mode (plain requests, no speculation, no block being
        #: cached or evictable): whether the deployment allows it, and the running
        #: requests' rows while in it.
        self.vector_ok = self.spec is None
        self.vec: RunningRows | None = None
        self.vector_batch = _VectorBatch(self)  # (what its step in flight is, in the mode)
        #: from ``flat[0]`` positions on, ``blocks_for(p) = ceil(p / block_size) +
        #: flat[1]`` (the private blocks no longer grow)
        self.flat = roofline.flat_blocks()

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones and evictable cached ones."""
        return self.pool.free

    def load(self) -> int:
        """Requests running or waiting here (the routers' measure of load)."""
        return len(self.running) + self.waiting.count

    def queued_prefill(self) -> int:
        """Prompt positions still to compute here: the rest of every running prefill and
        the whole prefill of every waiting request (``kv_aware``'s queue)."""
        self.sync_running()
        total = 0
        for r in self.running:
            left = r.prompt + (r.output - 1 if r.output > 1 else 0) - r.computed
            if left > 0:
                total += left
        for r in self.waiting:
            total += r.prompt + (r.output - 1 if r.output > 1 else 0)
        return total

    def blocks_for(self, positions: int) -> int:
        if self.private:
            return self.roofline.blocks_for(positions)
        return -(-positions // self.block_size)

    def first_chunk(self, r: _Request, budget: int) -> tuple[int, int, int, int] | None:
        """Admitting ``r`` (nothing resident) with ``budget`` tokens left in the step: its
        cached leading blocks, the positions of its first chunk on top of them, the new
        blocks that chunk needs, and the cached blocks it takes off the free queue. None
        when its stage cannot run within ``budget`` (chunked prefill off)."""
        hit, touched = self.kv.computed_blocks(r) if r.hash_limit else (0, 0)
        c = hit * self.block_size
        # the first stage always runs as one sequence (a group's prompt)
        left, _ = self._stage(r, c)
        if left:
            if not self.chunked and left > budget:
                return None
            n = min(left, budget, self.chunk_cap)
        else:
            n = 1  # a preempted request whose whole re-prefill is cached decodes at once
        return hit, n, self.blocks_for(c + n) - hit, touched

    def first_chunk_blocks(self, r: _Request) -> int:
        """Free blocks admitting ``r`` takes with a whole step's budget (the admission
        ledger's measure)."""
        chunk = self.first_chunk(r, self.budget)
        if chunk is None:
            return self.blocks_for(self._stage(r, 0)[0])
        return chunk[2] + chunk[3]

    def verify_reserve(self) -> int:
        """Speculative decoding (Rule 8): the blocks the running decoding requests' next
        verify steps take beyond those they hold -- from where the step in flight leaves
        them (its accepted positions are drawn), at the draft length the running batch
        gets. The scheduler grows running requests before it admits any, so an admission
        finds only what is left. O(running)."""
        spec = self.spec
        if spec is None:
            return 0
        gamma = spec.gamma_for(self.running_seqs)
        if not gamma:
            return 0
        advance = {id(r): n for r, n in self.batch}
        total = 0
        for r in self.running:
            step = advance.get(id(r), 0)
            c = r.computed + step
            out = r.output
            if step and c >= r.prompt:
                out = min(c - r.prompt + 1, r.max_tokens)
            if c < r.prompt + (out - 1 if out > 1 else 0):
                continue  # prefilling: its chunks are what the budget gives
            left = r.max_tokens - out - 1
            width = 1 + (gamma if gamma < left else (left if left > 0 else 0))
            need = self.group_blocks(r, c + width) - r.blocks
            if need > 0:
                total += need
        return total

    def group_blocks(self, r: _Request, positions: int) -> int:
        """Blocks a request holding ``positions`` positions per sequence needs (Rule 4)."""
        base = self.blocks_for(positions)
        if r.n == 1 or positions <= r.prompt:
            return base
        shared = r.prompt // self.block_size
        return shared + r.n * (base - shared)

    def _stage(self, r: _Request, c: int) -> tuple[int, int]:
        """The work ``r`` has left in its current stage from ``c`` computed positions:
        (positions per sequence, sequences). A prefill of a plain request is one stage;
        a group's prompt (one sequence) and its re-prefilled outputs (n sequences) are
        two; decoding is one position per sequence."""
        out = r.output
        prefill_len = r.prompt + (out - 1 if out > 1 else 0)
        if c < prefill_len:
            if r.n == 1:
                return prefill_len - c, 1
            if c < r.prompt:
                return r.prompt - c, 1
            return prefill_len - c, r.n
        return 0, r.n

    # ------------------------------------------------------------------ preemption
    def _victim(self, current: _Request) -> _Request:
        """The running request to preempt: among those not yet in this step's batch (the
        current one included), by policy."""
        mark = self.step_id
        candidates = (r for r in self.running if r.mark != mark or r is current)
        if self.policy == "fcfs":
            for r in reversed(self.running):
                if r.mark != mark or r is current:
                    return r
            return current
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival, r.admit_seq))
        return max(candidates, key=lambda r: (r.max_tokens - r.output, r.admit_seq))

    def _preempt(self, r: _Request) -> None:
        self.kv.free(r)
        r.room = 0
        r.computed = 0
        r.preemptions += 1
        r.state = _WAITING
        r.mark = -1
        self.running.remove(r)
        self.running_seqs -= r.n
        self.waiting.push_front(r)

    # ------------------------------------------------------------------ vectorised mode
    def sync_running(self) -> None:
        """Rule 10: write the decoding requests' lazy ``computed`` and ``output`` back
        before a reader looks at the objects."""
        vec = self.vec
        if vec is not None:
            vec.sync(self.running[: vec.size])

    def devectorise(self) -> None:
        """Leave the vectorised mode (Rule 10): the decoding requests take their counts
        back and a step in flight becomes the list of (request, positions) it stands for."""
        vec = self.vec
        if vec is None:
            return
        rows = self.running[: vec.size]
        vec.sync(rows)
        if isinstance(self.batch, _VectorBatch):
            self.batch = list(zip(rows, vec.ns(), strict=True))
        self.vec = None

    def _schedule_vector(self, now: float) -> tuple[Any, Any, Any, int] | None:
        """Rule 10: the batch starting at ``now`` chosen over the rows, when the step
        takes every running request whole (the budget holds all their chunks, the free
        blocks all their new blocks); None (nothing changed) otherwise. Returns what
        :meth:`schedule` returns, the batch a :class:`_VectorBatch` (or a list, when a
        group is admitted); in the vectorised mode ``n`` and ``c`` are None and the
        step's terms are in ``step_terms``.

        The rows ``[0, vec.decoding)`` are known to decode (one position each; lazily:
        :mod:`~inference_lab.core.running_rows` Rule 4): only those filed to grow now
        and the others' chunks are worked out."""
        running = self.running
        k = len(running)
        vec = self.vec
        if vec is None:
            rf = self.roofline
            vec = self.vec = RunningRows(running, rf.room_for, windows=rf.window_classes())
        decoding = vec.decoding
        budget = self.budget
        g = vec.g
        due = vec.grow_cal.get(g)  # decoding rows whose next position needs a block
        need = 0
        wants: list[int] | None = None  # (None: each of them takes one block)
        if due is not None:
            # Past the private blocks' table, a row whose room is what its blocks hold
            # grows by one block per block_size positions: the common case, in O(1) each.
            flat, tail = self.flat
            bs = self.block_size
            for r, c in due:
                room = r.room
                if room - c != g or room < flat or room != (r.blocks - tail) * bs:
                    blocks_for = self.blocks_for
                    wants = [blocks_for(c + g + 1) for _, c in due]
                    for (q, _), want in zip(due, wants, strict=True):
                        if want > q.blocks:
                            need += want - q.blocks
                    break
            else:
                need = len(due)
        # the rows that do not decode: their positions and contexts, then admissions'
        rest_rows = running[decoding:k]
        rest_n: list[int] = []
        rest_c: list[int] = []
        grown: list[tuple[_Request, int]] = []  # those that need blocks: their positions
        total = decoding
        if rest_rows:  # a step's admissions and prefill chunks: in Python, row by row
            cap = self.chunk_cap
            for r in rest_rows:
                c = r.computed
                out = r.output
                left = r.prompt + (out - 1 if out > 1 else 0) - c
                n = (left if left < cap else cap) if left > 0 else 1
                rest_n.append(n)
                rest_c.append(c)
                total += n
                if c + n > r.room:
                    grown.append((r, c + n))
        if total > budget:
            return None
        pool = self.pool
        wanted: list[int] = []
        if grown:
            blocks_for = self.blocks_for
            wanted = [blocks_for(p) for _, p in grown]
            for (r, _), w in zip(grown, wanted, strict=True):
                if w > r.blocks:
                    need += w - r.blocks
        if need > pool.free:
            return None
        pool.free -= need
        room_for = self.roofline.room_for
        if grown:
            for (r, _), w in zip(grown, wanted, strict=True):
                if w > r.blocks:
                    r.blocks = w
                r.room = room_for(r.blocks)
        if due is not None:  # grown, each is filed for its next block
            grow_cal = vec.grow_cal
            del grow_cal[g]
            if wants is None:  # one block each: all are filed block_size positions on
                for r, _ in due:
                    r.blocks += 1
                    r.room += bs
                later = grow_cal.get(g + bs)
                if later is None:
                    grow_cal[g + bs] = due
                else:
                    later += due
            else:
                for entry, want in zip(due, wants, strict=True):
                    r, c = entry
                    if want > r.blocks:
                        r.blocks = want
                    r.room = room_for(r.blocks)
                    key = r.room - c
                    slot = grow_cal.get(key)
                    if slot is None:
                        grow_cal[key] = [entry]
                    else:
                        slot.append(entry)
        vec.rest_n = rest_n
        vec.step_decoding = decoding
        self.step_gamma = 0
        self.step_id += 1
        mark = self.step_id
        budget -= total
        batch: Any = self.vector_batch
        ns: Any = None
        cs: Any = None
        while budget > 0 and self.waiting.count:
            admitted = self.admit_head(now, mark, budget)
            if admitted is None:
                break
            r, n = admitted
            if isinstance(batch, _VectorBatch) and (r.n != 1 or pool.filling):
                rows = self.running[: vec.size]
                self.devectorise()
                batch = list(zip(rows, vec.ns(), strict=True))
                ns = [n for _, n in batch]
                cs = [q.computed for q, _ in batch]
            if isinstance(batch, _VectorBatch):
                vec.append(n)  # (to rest_n)
                rest_c.append(r.computed)
            else:
                batch.append((r, n))
                ns.append(n)
                cs.append(r.computed)
            budget -= n
        self.step_budget = budget
        self.step_mark = mark
        if not isinstance(batch, _VectorBatch):
            return batch, ns, cs, 0
        rf = self.roofline
        if rf.has_mla():
            self.step_terms = rf.batch_terms(vec.ns(), vec.computed_now(running))
        else:
            self.step_terms = (
                rf.decode_terms_of(decoding, vec.decode_sums(), rest_n, rest_c)
                if rest_n
                else BatchTerms(decoding, decoding, vec.decode_totals(), [])  # (the same)
            )
        return batch, None, None, 0

    # ------------------------------------------------------------------ one iteration
    def schedule(self, now: float) -> tuple[Any, Any, Any, int]:
        """Choose the batch starting at ``now``: running first in admission order, then
        admissions by policy when nothing was preempted. Returns (batch of (request,
        positions per sequence), n and c per batch sequence for the roofline, preempted).
        Re-runs a pass that preempted and scheduled nothing. In the vectorised mode (Rule
        10) the batch is a :class:`_VectorBatch` and ``n`` and ``c`` int64 arrays."""
        if self.vector_ok:
            size = len(self.running)
            pool = self.pool
            if (
                size >= (VECTOR_MIN if self.vec is None else VECTOR_MIN // 2)
                and self.running_seqs == size
                and not pool.filling
                and not pool.evictable
            ):
                chosen = self._schedule_vector(now)
                if chosen is not None:
                    return chosen
            if self.vec is not None:
                self.devectorise()
        total_preempted = 0
        spec = self.spec
        gamma = 0 if spec is None else spec.gamma_for(self.running_seqs)
        self.step_gamma = gamma
        while True:
            self.step_id += 1
            mark = self.step_id
            budget = self.budget
            chunk_cap = self.chunk_cap
            chunked = self.chunked
            room_for = self.roofline.room_for
            blocks_for = self.blocks_for
            pool = self.pool
            batch: list[tuple[_Request, int]] = []
            ns: list[int] = []
            cs: list[int] = []
            add_batch, add_n, add_c = batch.append, ns.append, cs.append
            preempted = 0
            running = self.running
            count = len(running)
            i = 0
            while i < count and budget > 0:
                r = running[i]
                c = r.computed
                if r.n == 1:  # the plain request: the hot path
                    out = r.output
                    prefill_len = r.prompt + (out - 1 if out > 1 else 0)
                    if c < prefill_len:
                        left = prefill_len - c
                        if not chunked and left > budget:
                            i += 1
                            continue
                        n = min(left, budget, chunk_cap)
                    else:
                        n = 1
                        if gamma:  # a verify step (Rule 8): 1 + gamma, within max_tokens
                            left = r.max_tokens - r.output - 1
                            n += gamma if gamma < left else (left if left > 0 else 0)
                            if n > budget:
                                n = budget
                    seqs = 1
                    if c + n <= r.room:  # its blocks hold it: no block to find
                        r.mark = mark
                        add_batch((r, n))
                        add_n(n)
                        add_c(c)
                        budget -= n
                        i += 1
                        continue
                    need = blocks_for(c + n) - r.blocks
                else:
                    left, seqs = self._stage(r, c)
                    if left:
                        if not chunked and left * seqs > budget:
                            i += 1
                            continue
                        n = min(left, budget // seqs, chunk_cap)
                    else:
                        n = 1
                        if gamma:  # a verify step (Rule 8)
                            left = r.max_tokens - r.output - 1
                            n += gamma if gamma < left else (left if left > 0 else 0)
                            if n * seqs > budget:
                                n = max(1, budget // seqs)
                    if n * seqs > budget or n == 0:
                        i += 1  # this step's budget cannot hold every sequence
                        continue
                    need = self.group_blocks(r, c + n) - r.blocks
                if need > pool.free:
                    victim = self._victim(r)
                    vi = running.index(victim)
                    self._preempt(victim)
                    count -= 1
                    preempted += 1
                    if victim is not r and vi < i:
                        i -= 1
                    continue
                if need > 0:
                    pool.free -= need
                    if pool.evictable:  # cached blocks may have to go (empty ones first)
                        pool.evict_excess()
                    r.blocks += need
                if r.n == 1:
                    r.room = room_for(r.blocks)
                r.mark = mark
                batch.append((r, n))
                if seqs == 1:
                    ns.append(n)
                    cs.append(c)
                else:
                    ns.extend([n] * seqs)
                    cs.extend([c] * seqs)
                budget -= n * seqs
                i += 1
            if not preempted:
                while budget > 0 and self.waiting.count:
                    admitted = self.admit_head(now, mark, budget)
                    if admitted is None:
                        break
                    r, n = admitted
                    batch.append((r, n))
                    ns.append(n)
                    cs.append(r.computed)  # its cached prefix, if any (Rule 7)
                    budget -= n
            total_preempted += preempted
            if batch or not preempted:
                self.step_budget = budget
                self.step_mark = mark
                return batch, ns, cs, total_preempted

    def admit_head(self, now: float, mark: int, budget: int) -> tuple[_Request, int] | None:
        """Admit the head of the waiting queue into a step starting at ``now`` with
        ``budget`` tokens left, if the cap, the budget and the free blocks allow: it runs
        its first prefill chunk there, on top of the prefix its worker has cached (its
        ``computed`` on return). Returns (request, positions) or None."""
        r = self.waiting.peek()
        if r is None:
            return None
        if self.running_seqs + r.n > self.max_num_seqs and self.running_seqs:
            return None
        if r.n == 1 and not r.hash_limit:  # first_chunk of a plain request, no prefix
            out = r.output
            n = r.prompt + (out - 1 if out > 1 else 0)  # its whole (re-)prefill
            if n > budget:
                if not self.chunked:
                    return None
                n = budget
            if n > self.chunk_cap:
                n = self.chunk_cap
            hit = touched = 0
            need = self.blocks_for(n)
        else:
            chunk = self.first_chunk(r, budget)
            if chunk is None:
                return None
            hit, n, need, touched = chunk
        if need + touched > self.pool.free:
            return None
        self.waiting.pop()
        self.kv.admit(r, hit, need, r.first_scheduled < 0)
        r.state = _RUNNING
        r.admit_seq = next(self.admit_seq)
        if r.first_scheduled < 0:
            r.first_scheduled = now
        r.mark = mark
        self.running.append(r)
        self.running_seqs += r.n
        return r, n


class _VectorBatch:
    """The step in flight of a worker in the vectorised mode (Rule 10): every row, each at
    its ``n`` (1 for the decoding ones). Iterating it (the paths that need the objects)
    syncs them first; appending a plain request adds its row, a group leaves the
    vectorised mode."""

    __slots__ = ("worker",)

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker

    def _rows(self) -> RunningRows:
        vec = self.worker.vec
        assert vec is not None  # the worker leaves the mode through devectorise()
        return vec

    def __len__(self) -> int:
        return self._rows().size

    def __iter__(self) -> Iterator[tuple[_Request, int]]:
        w = self.worker
        vec = self._rows()
        rows = w.running[: vec.size]
        vec.sync(rows)
        return iter(list(zip(rows, vec.ns(), strict=True)))

    def append(self, item: tuple[_Request, int]) -> None:
        """A request admitted into the step in flight (a late arrival, Rule 2)."""
        r, n = item
        w = self.worker
        if r.n != 1 or w.pool.filling:
            w.devectorise()
            w.batch.append(item)
            return
        self._rows().append(n)


class _Group:
    """The data-parallel attention ranks of one replica (Rule 9): one boundary event for all
    of them, and the lockstep step in flight."""

    __slots__ = ("ranks", "scheduled", "boundary_seq", "busy", "step_start")

    def __init__(self, ranks: list[_Worker]) -> None:
        self.ranks = ranks
        self.scheduled = False  # a boundary event for this group is in the heap
        self.boundary_seq = -1
        self.busy = False  # a lockstep step is in flight
        self.step_start = 0.0
        for w in ranks:
            w.group = self


class Engine:
    """One deployment: ``replicas`` workers behind a router (``replicas * dp_attention``
    with data-parallel attention ranks), and the event heap.

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
        self.deployment = deployment
        self.roofline = Roofline(deployment)
        self._kv_events: list[KVEvent] | None = [] if record_kv_events else None
        self.workers = [
            _Worker(i, deployment, self.roofline, self._kv_events)
            for i in range(deployment.workers)
        ]
        dp = deployment.hardware.dp_attention
        self.groups = (
            [_Group(self.workers[i : i + dp]) for i in range(0, len(self.workers), dp)]
            if dp > 1
            else []
        )
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
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._rr = 0
        hw = deployment.hardware
        self._router = hw.router
        self._load_ratio = hw.affinity_load_ratio
        self._queue_weight = hw.kv_aware_queue_weight
        self._pending = 0
        self._preemptions = 0
        self._steps = 0
        self._finished = 0
        self._aborted = 0
        self._max_num_seqs = deployment.scheduler.max_num_seqs
        #: a plain request of at most this many positions (prompt + max_tokens) passes
        #: every check of check_fits (each is a bound on the total: max_seq_len, the KV
        #: blocks it needs -- non-decreasing in the total --, the budget without chunks)
        sched = deployment.scheduler
        self._fits_total = min(
            deployment.model.max_seq_len,
            self.roofline.room_for(self.roofline.total_blocks),
            (sched.max_num_batched_tokens + 1) if not sched.enable_chunked_prefill else 1 << 62,
        )
        #: seconds from a request's arrival to its entering the engine (Rule 12)
        self._frontend = sched.frontend_latency

    # ------------------------------------------------------------------ admission
    def check_fits(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> RequestRefused | None:
        """Why a request of this size (``n`` sequences sharing the prompt) can never run
        here, or None. Pure: the serving layer calls it before admission to answer 400
        ``context_length_exceeded``."""
        dep = self.deployment
        total = prompt_tokens + max_tokens
        if total > dep.model.max_seq_len:
            return RequestRefused(
                "max_seq_len",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds the model's max_seq_len of {dep.model.max_seq_len}",
            )
        worker = self.workers[0]
        blocks = worker.blocks_for(total)
        if n > 1:
            shared = prompt_tokens // worker.block_size
            blocks = shared + n * (blocks - shared)
        if blocks > self.roofline.total_blocks:
            what = f"{total} tokens" if n == 1 else f"{total} tokens in each of n = {n} sequences"
            return RequestRefused(
                "kv_cache",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {what} "
                f"need {blocks} KV blocks but a replica's KV cache holds "
                f"{self.roofline.total_blocks}",
            )
        sched = dep.scheduler
        budget = sched.max_num_batched_tokens
        if n > budget:
            return RequestRefused(
                "batch_tokens",
                f"n = {n} sequences cannot decode together in max_num_batched_tokens ({budget})",
            )
        if not sched.enable_chunked_prefill:
            # the largest stage that must run in one step: a plain request's whole
            # re-prefill; a group's prompt, or its n re-prefilled outputs
            largest = total - 1 if n == 1 else max(prompt_tokens, n * (max_tokens - 1))
            if largest > budget:
                return RequestRefused(
                    "batch_tokens",
                    f"prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) need "
                    f"{largest} positions in one step, more than max_num_batched_tokens "
                    f"({budget}) with chunked prefill disabled",
                )
        return None

    def submit(self, spec: RequestSpec, *, preorder: int | None = None) -> int:
        """Queue an arrival at ``max(spec.arrival_time, now)`` and return its id. Nothing
        enters a worker until ``step()`` handles the arrival. Raises RequestRefused for a
        request that can never fit, and ValueError for a malformed spec.

        ``preorder`` (the simulator's lazy feed of an open loop, Rule 11) files the arrival
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
        r = _Request(rid, spec, arrival, target, stamp)
        self.workers[0].kv.prepare(r)  # the same answer on every worker
        self._requests[rid] = r
        self._pending += 1
        seq = next(self._seq) if preorder is None else preorder - _PREORDER
        heapq.heappush(self._heap, (arrival, seq, _ARRIVAL, r))
        return rid

    def abort(self, request_id: int) -> bool:
        """Remove a request wherever it is; free its blocks; it emits nothing more.
        Idempotent: returns False when the id is unknown, finished or already aborted."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        if r.state == _PENDING:
            self._pending -= 1  # its heap entry is skipped lazily
        elif r.state == _WAITING:
            self.workers[r.worker].waiting.remove(r)
        elif r.state == _RUNNING:
            w = self.workers[r.worker]
            w.devectorise()
            w.kv.free(r)
            w.running.remove(r)
            w.running_seqs -= r.n
        r.state = _DONE
        self._aborted += 1
        return True

    # ------------------------------------------------------------------ time
    def next_event_time(self) -> float | None:
        heap = self._heap
        while heap:
            _, seq, kind, payload = heap[0]
            if kind == _ARRIVAL and payload.state != _PENDING:
                heapq.heappop(heap)  # an aborted arrival
            elif kind != _ARRIVAL and seq != payload.boundary_seq:
                heapq.heappop(heap)  # a step end moved by a late arrival
            else:
                break
        return heap[0][0] if heap else None

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

    def _route(self, r: _Request, extra: Sequence[int] | None = None) -> _Worker:
        """The worker an arrival goes to (the deployment's ``router``); ``extra`` counts
        requests routed to each worker that have not arrived yet (the serving layer routes
        at admission: :meth:`route`), which add to its load:

        - ``round_robin``: in turn;
        - ``least_loaded``: fewest requests running + waiting, then the lowest index;
        - ``prefix_affinity``: among the workers whose load stays under the bound
          ``ceil(affinity_load_ratio * (total load + 1) / replicas)`` (consistent
          hashing with bounded loads: the least loaded worker is always under it), the
          one with the longest cached prefix of the request, then the least loaded;
        - ``kv_aware``: the lowest ``uncached prompt tokens + kv_aware_queue_weight *
          queued prefill tokens``, then the least loaded.
        """
        workers = self.workers
        if len(workers) == 1:
            return workers[0]
        router = self._router

        def load(w: _Worker) -> int:
            return w.load() if extra is None else w.load() + extra[w.index]

        if router == "least_loaded":
            return min(workers, key=lambda w: (load(w), w.index))
        if router == "prefix_affinity":
            loads = [load(w) for w in workers]
            bound = -(-self._load_ratio * (sum(loads) + 1) // len(workers))
            return min(
                (w for w, load in zip(workers, loads, strict=True) if load < bound),
                key=lambda w: (-w.kv.hit_tokens(r), loads[w.index], w.index),
            )
        if router == "kv_aware":
            weight = self._queue_weight
            return min(
                workers,
                key=lambda w: (
                    r.prompt - w.kv.hit_tokens(r) + weight * w.queued_prefill(),
                    load(w),
                    w.index,
                ),
            )
        w = workers[self._rr % len(workers)]
        self._rr += 1
        return w

    # ------------------------------------------------------------------ admission ledger
    def _probe(self, spec: RequestSpec) -> _Request:
        """A request not submitted, as the router and the block counts see it."""
        r = _Request(0, spec, self.now, spec.max_tokens, self.now)
        self.workers[0].kv.prepare(r)
        return r

    def route(self, spec: RequestSpec, extra: Sequence[int], *, advance: bool = True) -> int:
        """Route ``spec`` now, before it is submitted (it then carries the worker): the
        router's choice with ``extra[i]`` requests already routed to worker ``i`` and not
        yet arrived. A round robin advances unless ``advance`` is False (a look at the
        choice). For the serving layer, whose admission must know the worker a request
        will wait on."""
        rr = self._rr
        index = self._route(self._probe(spec), extra).index
        if not advance:
            self._rr = rr
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
        the first running request is expected to finish, at each worker's current step
        time: the rest of the step in flight, then one step per prefill chunk and per
        token it has left (its hidden length, as the simulation knows it) -- with
        speculative decoding, per mean acceptance length of tokens (Rule 8). None when
        nothing runs."""
        best: float | None = None
        spec = self._spec
        for w in self.workers:
            if not w.running or not w.batch:
                continue
            w.sync_running()
            step = w.step_end - w.step_start
            chunk = min(w.budget, w.chunk_cap)
            per_step = 1.0
            if spec is not None:
                gamma = spec.gamma_for(w.running_seqs)
                per_step = expected_length(self.deployment.acceptance_rates, gamma)
            for r in w.running:
                out = r.output
                prefill_len = r.prompt + (out - 1 if out > 1 else 0)
                left = max(0, prefill_len - r.computed)
                tokens = r.target - max(out, 1)
                if per_step != 1.0:
                    tokens = math.ceil(tokens / per_step)
                steps = -(-left // chunk) + tokens
                eta = max(0.0, w.step_end - now) + max(0, steps - 1) * step
                if best is None or eta < best:
                    best = eta
        return best

    def step(self) -> StepEvents:
        """Handle the earliest event and return what became visible at its time."""
        heap = self._heap
        while True:  # the earliest live event (next_event_time's clean-up, inline)
            if not heap:
                raise RuntimeError("step() called with no event pending")
            t, seq, kind, payload = heapq.heappop(heap)
            if kind == _ARRIVAL:
                if payload.state == _PENDING:
                    break  # (else an aborted arrival)
            elif seq == payload.boundary_seq:
                break  # (else a step end moved by a late arrival)
        if t > self.now:
            self.now = t
        now = self.now
        if kind == _ARRIVAL:
            self._arrive(payload, now)
            return _step_events(now, (), (), (payload.id,), None)
        if kind == _GROUP_BOUNDARY:
            return self._group_boundary(payload, now)
        return self._boundary(payload, now)

    def take_arrivals(self, before: float) -> int:
        """Handle the arrivals at the head of the event queue stamped before ``before``,
        up to the first other event: exactly what as many ``step()`` calls would do, in
        the same order, without a ``StepEvents`` each (each would report only its
        request in ``arrived``). Returns how many it handled (0: the next event is not
        such an arrival). For a caller that only counts arrivals: the simulator's loop."""
        heap = self._heap
        count = 0
        while heap:
            t, seq, kind, payload = heap[0]
            if kind == _ARRIVAL:
                if payload.state != _PENDING:
                    heapq.heappop(heap)  # an aborted arrival
                    continue
                if t >= before:
                    break
                heapq.heappop(heap)
                if t > self.now:
                    self.now = t
                self._arrive(payload, self.now)
                count += 1
            elif seq != payload.boundary_seq:
                heapq.heappop(heap)  # a step end moved by a late arrival
            else:
                break
        return count

    def _arrive(self, r: _Request, now: float) -> None:
        """The arrival of ``r`` at ``now``: it enters its worker's waiting queue, which
        steps at ``now`` if idle (or takes it into the step in flight: Rule 2)."""
        self._pending -= 1
        hint = r.hint
        workers = self.workers
        if hint is not None:
            w = workers[hint]
        else:  # (one worker: the router's answer, without asking)
            w = workers[0] if len(workers) == 1 else self._route(r)
        r.worker = w.index
        r.state = _WAITING
        w.waiting.push(r)
        g = w.group
        if g is not None:
            if not g.scheduled:
                g.scheduled = True
                g.boundary_seq = next(self._seq)
                heapq.heappush(self._heap, (now, g.boundary_seq, _GROUP_BOUNDARY, g))
            elif g.busy and r.stamp < g.step_start and w.waiting.count == 1:
                self._join_late(w, r)
        elif not w.scheduled:
            w.scheduled = True
            w.boundary_seq = next(self._seq)
            heapq.heappush(self._heap, (now, w.boundary_seq, _BOUNDARY, w))
        elif r.stamp < w.step_start and w.waiting.count == 1 and w.batch:
            self._join_late(w, r)

    def _join_late(self, w: _Worker, r: _Request) -> None:
        """``r`` reached the engine after the boundary of the step in flight although it
        arrived (``stamp``) before it (the caller took time to hand it over): it joins
        that step, as it would have at the boundary, if the step has room for it (Rule 2).
        The step is priced again with it and its end moves accordingly; the tokens of the
        step's other members were not yet emitted, so none is observed early."""
        g = w.group
        start = w.step_start if g is None else g.step_start
        admitted = w.admit_head(start, w.step_mark, w.step_budget)
        if admitted is None:
            return
        _, n = admitted
        r.arrival = r.stamp  # it is treated as having arrived when it was stamped
        w.batch.append(admitted)
        terms = w.step_terms
        assert terms is not None  # set with the step in flight
        rf = self.roofline
        rf.add_sequence(terms, n, r.computed)
        if w.step_plain is not None:  # a speculative step: its batch without drafts too
            rf.add_sequence(w.step_plain, n, r.computed)
            w.step_pns.append(n)
            w.step_cs.append(r.computed)
        w.step_budget -= n
        if g is not None:  # a rank idle in its group's step gets its first member
            w.step_start = start
            cost, _ = self._price_group(g)
            end = start + cost.seconds * self.step_time_factor
            g.boundary_seq = next(self._seq)
            for rank in g.ranks:
                rank.step_end = end
            heapq.heappush(self._heap, (end, g.boundary_seq, _GROUP_BOUNDARY, g))
            return
        cost = rf.price(terms) if w.step_plain is None else self._price_worker(w)[0]
        w.boundary_seq = next(self._seq)
        end = w.step_start + cost.seconds * self.step_time_factor
        w.step_end = end
        heapq.heappush(self._heap, (end, w.boundary_seq, _BOUNDARY, w))

    def _complete(
        self, w: _Worker, now: float, emit: list[tuple[int, int]], finished: list[Finished]
    ) -> tuple[tuple[int, int], ...]:
        """The step of ``w`` that ends at ``now``: its members' positions become computed
        (a verify's accepted ones: Rule 8), their tokens emitted, the finished ones freed.
        Returns the tokens of its first members (the vectorised mode's decoding rows:
        one each), which come before those it adds to ``emit``."""
        if isinstance(w.batch, _VectorBatch):
            return self._complete_vector(w, now, emit, finished)
        any_done = False
        add = emit.append
        running = _RUNNING
        kv = w.kv
        if kv.pool.filling:  # members whose positions fill blocks their hashes name
            kv.cache_batch(w.batch)
        for r, n in w.batch:
            if r.state != running:
                continue  # aborted or preempted while its step was in flight
            c = r.computed + n
            r.computed = c
            prompt = r.prompt
            if c >= prompt:
                new = c - prompt + 1
                if new > r.max_tokens:
                    new = r.max_tokens
                out = r.output
                if new > out:
                    if out == 0:
                        r.first_token_time = now
                    add((r.id, new - out))
                    r.output = new
                    if new >= r.target:
                        any_done = True
                        self._finish(w, r, now, finished)
        if any_done:
            w.running = [r for r in w.running if r.state == _RUNNING]
        return ()

    def _finish(self, w: _Worker, r: _Request, now: float, finished: list[Finished]) -> None:
        """``r`` emitted its last token at ``now``: free it and report it."""
        r.state = _DONE
        w.kv.free(r)
        w.running_seqs -= r.n
        del self._requests[r.id]
        self._finished += 1
        finished.append(
            _finished(
                request_id=r.id,
                prompt_tokens=r.prompt,
                output_tokens=r.output,
                finish_reason="length" if r.output >= r.max_tokens else "stop",
                arrival_time=r.arrival - self._frontend if self._frontend else r.arrival,
                first_scheduled_time=r.first_scheduled,
                first_token_time=r.first_token_time,
                finish_time=now,
                preemptions=r.preemptions,
                n=r.n,
                cached_tokens=r.cached,
                worker=w.index,
            )
        )

    def _complete_vector(
        self, w: _Worker, now: float, emit: list[tuple[int, int]], finished: list[Finished]
    ) -> tuple[tuple[int, int], ...]:
        """:meth:`_complete` in the vectorised mode (Rule 10): every row was in the step,
        each at its ``n``; the same tokens, first-token times and completions, in row
        order. The rows ``[0, step_decoding)`` decoded: each emits one token (the decode
        counter moves on; their finishes are the ones filed for it), returned as one
        tuple; the rows after them that emitted for the first time decode from now on."""
        vec = w.vec
        assert vec is not None  # a _VectorBatch in flight
        k = vec.size
        decoding = vec.step_decoding
        running = w.running
        # the decoding rows' positions and tokens, lazily; those whose last token it was
        finishing: list[Any] | None = vec.advance()
        head = vec.head  # the decoding rows' (id, 1) each, kept while they stay the same
        if head is None:
            head = vec.head = tuple(vec.pairs)
        done: list[int] = []
        if finishing is not None:
            for r in finishing:
                done.append(running.index(r, 0, decoding))
            if len(done) > 1:
                done.sort()
        still = k  # the first row that did not emit (k: none)
        if decoding < k:  # the others: the per-request loop's arithmetic
            for i, (r, n) in enumerate(zip(running[decoding:k], vec.rest_n, strict=True), decoding):
                c = r.computed + n
                r.computed = c
                prompt = r.prompt
                if c >= prompt:
                    new = c - prompt + 1
                    if new > r.max_tokens:
                        new = r.max_tokens
                    before = r.output
                    if new > before:
                        if before == 0:
                            r.first_token_time = now
                        emit.append((r.id, new - before))
                        r.output = new
                        if new >= r.target:
                            done.append(i)
                        continue
                if still == k:
                    still = i
        if done:
            for i in done:
                r = running[i]
                if i < decoding:
                    vec.finish_decoding(r)
                self._finish(w, r, now, finished)
            vec.drop(done)
            for i in reversed(done):
                del running[i]
            still -= len(done) if still == k else sum(1 for i in done if i < still)
        if still > vec.decoding:
            vec.start_decoding(running[vec.decoding : still])
        return head

    def _boundary(self, w: _Worker, now: float) -> StepEvents:
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        head = self._complete(w, now, tokens, finished)
        batch, ns, cs, preempted = w.schedule(now)
        self._preemptions += preempted
        info = None
        vector = type(batch) is _VectorBatch  # (never empty: no need to ask its length)
        if vector or batch:
            if self._spec is None:
                if ns is None:  # the vectorised mode priced its batch (Rule 10)
                    terms = w.step_terms
                    assert terms is not None
                else:
                    terms = self.roofline.batch_terms(ns, cs)
                cost = self.roofline.price(terms)
                w.step_terms = terms
            else:
                counts = self._draft(w, batch, cs)
                cost, plain = self._price_worker(w)
                drafted = w.step_terms
                assert drafted is not None  # set by _draft
                terms = drafted
            duration = cost.seconds * self.step_time_factor
            w.batch = batch
            w.step_start = now
            w.step_end = now + duration
            w.boundary_seq = next(self._seq)
            heapq.heappush(self._heap, (now + duration, w.boundary_seq, _BOUNDARY, w))
            self._steps += 1
            roof = cost.roofline if cost.roofline > 0 else 1.0
            info = _step_info(
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
            if self._spec is not None:
                info = attrs.evolve(
                    info,
                    drafts=counts[0],
                    draft_tokens=counts[1],
                    accepted_tokens=counts[2],
                    accepted_per_position=tuple(counts[3]),
                    plain_duration=self._plain_equivalent(plain, [w], counts[0], counts[2]),
                )
        else:
            w.batch = []
            w.scheduled = False
        emitted = head + tuple(tokens) if tokens else head if head else ()
        return _step_events(now, emitted, tuple(finished) if finished else (), (), info)

    def _group_boundary(self, g: _Group, now: float) -> StepEvents:
        """Rule 9: the lockstep step of a replica's ranks ends at ``now``; each rank chooses
        its next batch and they start together, priced as one step."""
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        for w in g.ranks:
            rest = len(tokens)
            head = self._complete(w, now, tokens, finished)
            if head:  # this rank's first tokens, before those it added
                tokens[rest:rest] = head
        preempted = 0
        spec = self._spec is not None
        counts: list[Any] = [0, 0, 0, []]
        any_batch = False
        for w in g.ranks:
            batch, ns, cs, p = w.schedule(now)
            preempted += p
            w.batch = batch
            if spec:
                c = self._draft(w, batch, cs)
                counts[0] += c[0]
                counts[1] += c[1]
                counts[2] += c[2]
                per = counts[3]
                for j, value in enumerate(c[3]):
                    if j < len(per):
                        per[j] += value
                    else:
                        per.append(value)
            elif ns is not None:  # (else the vectorised mode set it: Rule 10)
                w.step_terms = self.roofline.batch_terms(ns, cs)
            if batch:
                any_batch = True
        self._preemptions += preempted
        if not any_batch:
            g.scheduled = False
            g.busy = False
            return StepEvents(
                time=now, tokens=tuple(tokens), finished=tuple(finished), arrived=(), step=None
            )
        cost, plain = self._price_group(g)
        duration = cost.seconds * self.step_time_factor
        g.busy = True
        g.step_start = now
        g.boundary_seq = next(self._seq)
        for w in g.ranks:
            w.step_start = now
            w.step_end = now + duration
        heapq.heappush(self._heap, (now + duration, g.boundary_seq, _GROUP_BOUNDARY, g))
        self._steps += 1
        roof = cost.roofline if cost.roofline > 0 else 1.0
        used = sum(w.total_blocks - w.pool.free for w in g.ranks)
        total = sum(w.total_blocks for w in g.ranks)
        seqs = sum(w.step_terms.seqs for w in g.ranks if w.step_terms is not None)
        num_tokens = sum(w.step_terms.tokens for w in g.ranks if w.step_terms is not None)
        info = StepInfo(
            worker=g.ranks[0].index,
            start=now,
            duration=duration,
            num_seqs=seqs,
            num_tokens=num_tokens,
            kv_usage=used / total,
            flop_util=cost.compute / roof,
            bw_util=cost.memory / roof,
            preempted=preempted,
            drafts=counts[0],
            draft_tokens=counts[1],
            accepted_tokens=counts[2],
            accepted_per_position=tuple(counts[3]),
            plain_duration=(
                self._plain_equivalent(plain, g.ranks, counts[0], counts[2]) if spec else 0.0
            ),
        )
        return StepEvents(
            time=now, tokens=tuple(tokens), finished=tuple(finished), arrived=(), step=info
        )

    # ------------------------------------------------------------------ speculative steps
    def _draft(
        self, w: _Worker, batch: list[tuple[_Request, int]], cs: list[int]
    ) -> tuple[int, int, int, list[int]]:
        """Rule 8, when ``w``'s batch is chosen: draw each verifying member's accepted count,
        turn its batch entry into the positions it will have computed at the step's end
        (``1 + accepted``, capped by its remaining length), and keep the step's terms with
        and without drafts. Returns (drafts, draft tokens, accepted tokens, accepted per
        position), counted per sequence."""
        draw = self._accept
        assert draw is not None
        rf = self.roofline
        ns: list[int] = []
        pns: list[int] = []
        dcs: list[int] = []
        seq_cs: list[int] = []
        drafts = draft_tokens = accepted_tokens = 0
        per: list[int] = []
        for i, (r, n) in enumerate(batch):
            c = r.computed
            seqs = 1 if r.n == 1 or c < r.prompt else r.n
            out = r.output
            width = n
            if n > 1 and c >= r.prompt + (out - 1 if out > 1 else 0):
                gamma = n - 1
                accepted = draw.draw(gamma)
                advance = 1 + accepted
                remaining = r.target - out
                batch[i] = (r, advance if advance < remaining else remaining)
                drafts += seqs
                draft_tokens += seqs * gamma
                accepted_tokens += seqs * accepted
                while len(per) < accepted:
                    per.append(0)
                for j in range(accepted):
                    per[j] += seqs
                dcs.extend([c] * seqs)
                width = 1
            if seqs == 1:
                ns.append(n)
                pns.append(width)
                seq_cs.append(c)
            else:
                ns.extend([n] * seqs)
                pns.extend([width] * seqs)
                seq_cs.extend([c] * seqs)
        w.step_terms = rf.batch_terms(ns, seq_cs)
        if dcs:
            w.step_plain = rf.batch_terms(pns, seq_cs)
            w.step_pns, w.step_cs, w.step_dcs = pns, seq_cs, dcs
        else:
            w.step_plain = None
            w.step_pns, w.step_cs, w.step_dcs = [], [], []
        return drafts, draft_tokens, accepted_tokens, per

    def _plain_equivalent(
        self, plain: StepCost, ranks: Sequence[_Worker], drafts: int, accepted: int
    ) -> float:
        """The seconds a step's tokens would take without speculation (its ``StepInfo``'s
        ``plain_duration``): the batch without drafts, then ``accepted / drafts`` more
        steps of one position for each drafting sequence (the mean extra tokens each
        emitted). Only for the speed-up estimate."""
        factor = self.step_time_factor
        if not drafts:
            return plain.seconds * factor
        rf = self.roofline
        terms = [rf.batch_terms([1] * len(w.step_dcs), [c + 1 for c in w.step_dcs]) for w in ranks]
        decode = rf.group_price(terms) if len(ranks) > 1 else rf.price(terms[0])
        return (plain.seconds + accepted / drafts * decode.seconds) * factor

    def _price_worker(self, w: _Worker) -> tuple[StepCost, StepCost]:
        """The step in flight of ``w`` with its drafter (Rule 8), and without drafts."""
        rf = self.roofline
        terms = w.step_terms
        assert terms is not None
        cost = rf.price(terms)
        if w.step_plain is None:
            return cost, cost
        plain = rf.price(w.step_plain)
        draft = rf.draft_time(plain.roofline, w.step_pns, w.step_cs, w.step_dcs, w.step_gamma)
        return rf.with_draft(cost, draft), plain

    def _price_group(self, g: _Group) -> tuple[StepCost, StepCost]:
        """The lockstep step of ``g`` (Rule 9), with its drafters, and without drafts. The
        drafter is priced over every rank's drafting sequences at once."""
        rf = self.roofline
        ranks = g.ranks
        empty = rf.batch_terms([], [])
        terms = [w.step_terms if w.step_terms is not None else empty for w in ranks]
        cost = rf.group_price(terms)
        if all(w.step_plain is None for w in ranks):
            return cost, cost
        plain = rf.group_price(
            [
                w.step_plain if w.step_plain is not None else t
                for w, t in zip(ranks, terms, strict=True)
            ]
        )
        pns: list[int] = []
        cs: list[int] = []
        dcs: list[int] = []
        for w in ranks:
            if w.step_plain is not None:
                pns += w.step_pns
                cs += w.step_cs
                dcs += w.step_dcs
        gamma = max(w.step_gamma for w in ranks)
        draft = rf.draft_time(plain.roofline, pns, cs, dcs, gamma)
        return rf.with_draft(cost, draft), plain

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

    #: Every step lasts this many times its roofline time (the test harness's slowdown).
    step_time_factor = 1.0

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
        workers = tuple(
            WorkerStatistics(
                waiting=w.waiting.count,
                running=len(w.running),
                running_seqs=w.running_seqs,
                kv_used_blocks=w.total_blocks - w.pool.free,
                kv_total_blocks=w.total_blocks,
                max_num_seqs=w.max_num_seqs,
                prefix_cache_queries=w.pool.queries,
                prefix_cache_hits=w.pool.hits,
                cached_blocks=w.pool.cached_blocks,
            )
            for w in self.workers
        )
        used = sum(ws.kv_used_blocks for ws in workers)
        total = sum(ws.kv_total_blocks for ws in workers)
        return EngineStatistics(
            now=self.now,
            pending_arrivals=self._pending,
            waiting=sum(ws.waiting for ws in workers),
            running=sum(ws.running for ws in workers),
            running_seqs=sum(ws.running_seqs for ws in workers),
            kv_used_blocks=used,
            kv_total_blocks=total,
            kv_usage=used / total if total else 0.0,
            preemptions=self._preemptions,
            steps=self._steps,
            finished=self._finished,
            aborted=self._aborted,
            max_num_seqs=self._max_num_seqs,
            workers=workers,
            prefix_caching=self.prefix_caching,
            prefix_cache_queries=sum(ws.prefix_cache_queries for ws in workers),
            prefix_cache_hits=sum(ws.prefix_cache_hits for ws in workers),
            cached_blocks=sum(ws.cached_blocks for ws in workers),
        )
