"""The engine core: requests, KV blocks, the scheduler, the event heap (``spec/engine.md``).

A pure discrete-event simulation with the h11 shape: ``submit``, ``abort``,
``next_event_time``, ``step``, ``statistics``; outputs are frozen event objects.

Rule 1: no trio, quart, hypercorn, ``time`` or global ``random``: time is a number of
        simulated seconds passed in and out (a test walks this module's imports).
Rule 2: a step's batch is chosen at its start time and its tokens and completions happen at
        its end time: both are returned by the one ``step()`` call that handles the event at
        that time (the step boundary), which also chooses the next batch. So an arrival
        stamped before a boundary joins the batch that starts at that boundary.
Rule 3: a request computes ``P + target - 1`` positions in all; the prefill pass emits
        token 1; a preempted request re-prefills ``P + output - 1`` positions emitting
        nothing, then decodes on.
Rule 4: KV blocks are conserved: a worker's free blocks plus the blocks held by its
        running requests always equal its total, whatever is finished, preempted or aborted.
Rule 5: ``max_num_seqs`` gates admission only: lowering it drains, it never evicts.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any

import attrs
import numpy as np

from inference_lab.config import Deployment
from inference_lab.errors import RequestRefused
from inference_lab.roofline import Roofline

_PENDING, _WAITING, _RUNNING, _DONE = 0, 1, 2, 3
_ARRIVAL, _BOUNDARY = 0, 1


@attrs.frozen
class RequestSpec:
    """What the caller asks for. ``target`` is where the request really stops (hidden from
    the scheduler); None means it runs to ``max_tokens``."""

    prompt_tokens: int
    max_tokens: int
    target: int | None = None
    priority: int = 0
    arrival_time: float = 0.0


@attrs.frozen
class Finished:
    """A completed request, reported at its finish time (the end of its last step)."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    preemptions: int


@attrs.frozen
class StepInfo:
    """The batch that started at a boundary on one worker."""

    worker: int
    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    kv_usage: float
    flop_util: float
    bw_util: float
    preempted: int


@attrs.frozen
class StepEvents:
    """What became visible at ``time``: tokens emitted (request id, count), completions
    (their last token is in ``tokens``), arrivals that entered a worker's waiting queue,
    and the batch that started (None if none did)."""

    time: float
    tokens: tuple[tuple[int, int], ...]
    finished: tuple[Finished, ...]
    arrived: tuple[int, ...]
    step: StepInfo | None


@attrs.frozen(kw_only=True)
class WorkerStatistics:
    waiting: int
    running: int
    kv_used_blocks: int
    kv_total_blocks: int
    max_num_seqs: int


@attrs.frozen(kw_only=True)
class EngineStatistics:
    now: float
    pending_arrivals: int
    waiting: int
    running: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_usage: float
    preemptions: int
    steps: int
    finished: int
    aborted: int
    max_num_seqs: int
    workers: tuple[WorkerStatistics, ...]


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
        "state",
        "worker",
        "mark",
        "admit_seq",
        "queue_key",
    )

    def __init__(self, rid: int, spec: RequestSpec, arrival: float, target: int) -> None:
        self.id = rid
        self.prompt = spec.prompt_tokens
        self.max_tokens = spec.max_tokens
        self.target = target
        self.priority = spec.priority
        self.arrival = arrival
        self.computed = 0
        self.output = 0
        self.first_token_time = -1.0
        self.first_scheduled = -1.0
        self.preemptions = 0
        self.blocks = 0
        self.state = _PENDING
        self.worker = -1
        self.mark = -1  # the step id whose batch holds this request
        self.admit_seq = 0
        self.queue_key: tuple[Any, ...] = ()


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

    def __init__(self, index: int, dep: Deployment, roofline: Roofline) -> None:
        sched = dep.scheduler
        self.index = index
        self.roofline = roofline
        self.total_blocks = roofline.total_blocks
        self.free_blocks = self.total_blocks
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
        self.batch: list[tuple[_Request, int]] = []
        self.scheduled = False  # a boundary event for this worker is in the heap
        self.admit_seq = itertools.count()
        self.step_id = 0

    def blocks_for(self, positions: int) -> int:
        if self.private:
            return self.roofline.blocks_for(positions)
        return -(-positions // self.block_size)

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
        self.free_blocks += r.blocks
        r.blocks = 0
        r.computed = 0
        r.preemptions += 1
        r.state = _WAITING
        r.mark = -1
        self.running.remove(r)
        self.waiting.push_front(r)

    # ------------------------------------------------------------------ one iteration
    def schedule(self, now: float) -> tuple[list[_Request], list[int], list[int], int]:
        """Choose the batch starting at ``now``: running first in admission order, then
        admissions by policy when nothing was preempted. Returns (requests, n, c,
        preempted). Re-runs a pass that preempted and scheduled nothing."""
        total_preempted = 0
        while True:
            self.step_id += 1
            mark = self.step_id
            budget = self.budget
            chunk_cap = self.chunk_cap
            chunked = self.chunked
            bs = self.block_size
            private = self.private
            reqs: list[_Request] = []
            ns: list[int] = []
            cs: list[int] = []
            preempted = 0
            running = self.running
            i = 0
            while i < len(running) and budget > 0:
                r = running[i]
                c = r.computed
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
                need = (
                    self.roofline.blocks_for(c + n) if private else -(-(c + n) // bs)
                ) - r.blocks
                if need > self.free_blocks:
                    victim = self._victim(r)
                    vi = running.index(victim)
                    self._preempt(victim)
                    preempted += 1
                    if victim is not r and vi < i:
                        i -= 1
                    continue
                if need > 0:
                    self.free_blocks -= need
                    r.blocks += need
                r.mark = mark
                reqs.append(r)
                ns.append(n)
                cs.append(c)
                budget -= n
                i += 1
            if not preempted:
                waiting = self.waiting
                while budget > 0 and waiting.count:
                    if len(running) >= self.max_num_seqs:
                        break
                    head = waiting.peek()
                    assert head is not None
                    r = head
                    out = r.output
                    prefill_len = r.prompt + (out - 1 if out > 1 else 0)
                    if not chunked and prefill_len > budget:
                        break
                    n = min(prefill_len, budget, chunk_cap)
                    need = self.blocks_for(n)
                    if need > self.free_blocks:
                        break
                    waiting.pop()
                    self.free_blocks -= need
                    r.blocks = need
                    r.state = _RUNNING
                    r.admit_seq = next(self.admit_seq)
                    if r.first_scheduled < 0:
                        r.first_scheduled = now
                    r.mark = mark
                    running.append(r)
                    reqs.append(r)
                    ns.append(n)
                    cs.append(0)
                    budget -= n
            total_preempted += preempted
            if reqs or not preempted:
                return reqs, ns, cs, total_preempted


class Engine:
    """One deployment: ``replicas`` workers behind a router, and the event heap.

    Called by ``inference-lab sim`` (as fast as the CPU allows) and by the serve runtime's
    engine task (paced to wall-clock). Not thread-safe; every method is synchronous.
    """

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.roofline = Roofline(deployment)
        self.workers = [
            _Worker(i, deployment, self.roofline) for i in range(deployment.hardware.replicas)
        ]
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._rr = 0
        self._router = deployment.hardware.router
        self._pending = 0
        self._preemptions = 0
        self._steps = 0
        self._finished = 0
        self._aborted = 0
        self._max_num_seqs = deployment.scheduler.max_num_seqs

    # ------------------------------------------------------------------ admission
    def check_fits(self, prompt_tokens: int, max_tokens: int) -> RequestRefused | None:
        """Why a request of this size can never run here, or None. Pure: the serving
        layer calls it before admission to answer 400 ``context_length_exceeded``."""
        dep = self.deployment
        total = prompt_tokens + max_tokens
        if total > dep.model.max_seq_len:
            return RequestRefused(
                "max_seq_len",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds the model's max_seq_len of {dep.model.max_seq_len}",
            )
        blocks = self.workers[0].blocks_for(total)
        if blocks > self.roofline.total_blocks:
            return RequestRefused(
                "kv_cache",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"need {blocks} KV blocks but a replica's KV cache holds "
                f"{self.roofline.total_blocks}",
            )
        sched = dep.scheduler
        if not sched.enable_chunked_prefill and total - 1 > sched.max_num_batched_tokens:
            return RequestRefused(
                "batch_tokens",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) - 1 = {total - 1} "
                f"positions exceed max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                "with chunked prefill disabled",
            )
        return None

    def submit(self, spec: RequestSpec) -> int:
        """Queue an arrival at ``max(spec.arrival_time, now)`` and return its id. Nothing
        enters a worker until ``step()`` handles the arrival. Raises RequestRefused for a
        request that can never fit, and ValueError for a malformed spec."""
        if spec.prompt_tokens < 1 or spec.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        target = spec.max_tokens if spec.target is None else spec.target
        if not 1 <= target <= spec.max_tokens:
            raise ValueError(f"target must be in 1..max_tokens, got {target}")
        refused = self.check_fits(spec.prompt_tokens, spec.max_tokens)
        if refused is not None:
            raise refused
        rid = next(self._ids)
        arrival = spec.arrival_time if spec.arrival_time > self.now else self.now
        r = _Request(rid, spec, arrival, target)
        self._requests[rid] = r
        self._pending += 1
        heapq.heappush(self._heap, (arrival, next(self._seq), _ARRIVAL, r))
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
            w.free_blocks += r.blocks
            r.blocks = 0
            w.running.remove(r)
        r.state = _DONE
        self._aborted += 1
        return True

    # ------------------------------------------------------------------ time
    def next_event_time(self) -> float | None:
        heap = self._heap
        while heap and heap[0][2] == _ARRIVAL and heap[0][3].state != _PENDING:
            heapq.heappop(heap)  # an aborted arrival
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

    def _route(self) -> _Worker:
        workers = self.workers
        if len(workers) == 1:
            return workers[0]
        if self._router == "least_loaded":
            return min(workers, key=lambda w: (len(w.running) + w.waiting.count, w.index))
        w = workers[self._rr % len(workers)]
        self._rr += 1
        return w

    def step(self) -> StepEvents:
        """Handle the earliest event and return what became visible at its time."""
        if self.next_event_time() is None:
            raise RuntimeError("step() called with no event pending")
        t, _seq, kind, payload = heapq.heappop(self._heap)
        if t > self.now:
            self.now = t
        now = self.now
        if kind == _ARRIVAL:
            r: _Request = payload
            self._pending -= 1
            w = self._route()
            r.worker = w.index
            r.state = _WAITING
            w.waiting.push(r)
            if not w.scheduled:
                w.scheduled = True
                heapq.heappush(self._heap, (now, next(self._seq), _BOUNDARY, w))
            return StepEvents(now, (), (), (r.id,), None)
        return self._boundary(payload, now)

    def _boundary(self, w: _Worker, now: float) -> StepEvents:
        tokens: list[tuple[int, int]] = []
        finished: list[Finished] = []
        any_done = False
        for r, n in w.batch:
            if r.state != _RUNNING:
                continue  # aborted or preempted while its step was in flight
            c = r.computed + n
            r.computed = c
            if c >= r.prompt:
                new = c - r.prompt + 1
                if new > r.max_tokens:
                    new = r.max_tokens
                if new > r.output:
                    if r.output == 0:
                        r.first_token_time = now
                    tokens.append((r.id, new - r.output))
                    r.output = new
                    if new >= r.target:
                        any_done = True
                        r.state = _DONE
                        w.free_blocks += r.blocks
                        r.blocks = 0
                        del self._requests[r.id]
                        self._finished += 1
                        finished.append(
                            Finished(
                                r.id,
                                r.prompt,
                                r.output,
                                "length" if r.output >= r.max_tokens else "stop",
                                r.arrival,
                                r.first_scheduled,
                                r.first_token_time,
                                now,
                                r.preemptions,
                            )
                        )
        if any_done:
            w.running = [r for r in w.running if r.state == _RUNNING]
        reqs, ns, cs, preempted = w.schedule(now)
        self._preemptions += preempted
        info = None
        if reqs:
            n_arr = np.array(ns, dtype=np.int64)
            c_arr = np.array(cs, dtype=np.int64)
            cost = self.roofline.step_cost(n_arr, c_arr)
            duration = cost.seconds
            w.batch = list(zip(reqs, ns, strict=True))
            heapq.heappush(self._heap, (now + duration, next(self._seq), _BOUNDARY, w))
            self._steps += 1
            roof = cost.roofline if cost.roofline > 0 else 1.0
            info = StepInfo(
                w.index,
                now,
                duration,
                len(reqs),
                int(n_arr.sum()),
                (w.total_blocks - w.free_blocks) / w.total_blocks,
                cost.compute / roof,
                cost.memory / roof,
                preempted,
            )
        else:
            w.batch = []
            w.scheduled = False
        return StepEvents(now, tuple(tokens), tuple(finished), (), info)

    # ------------------------------------------------------------------ state
    def num_waiting(self) -> int:
        return sum(w.waiting.count for w in self.workers)

    def num_running(self) -> int:
        return sum(len(w.running) for w in self.workers)

    def num_pending(self) -> int:
        """Arrivals submitted but not yet stepped into a worker's waiting queue."""
        return self._pending

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    def set_max_num_seqs(self, n: int) -> None:
        """Change the per-worker cap; effective at the next admission. Never evicts."""
        if n < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {n}")
        self._max_num_seqs = n
        for w in self.workers:
            w.max_num_seqs = n

    def statistics(self) -> EngineStatistics:
        workers = tuple(
            WorkerStatistics(
                waiting=w.waiting.count,
                running=len(w.running),
                kv_used_blocks=w.total_blocks - w.free_blocks,
                kv_total_blocks=w.total_blocks,
                max_num_seqs=w.max_num_seqs,
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
            kv_used_blocks=used,
            kv_total_blocks=total,
            kv_usage=used / total if total else 0.0,
            preemptions=self._preemptions,
            steps=self._steps,
            finished=self._finished,
            aborted=self._aborted,
            max_num_seqs=self._max_num_seqs,
            workers=workers,
        )
