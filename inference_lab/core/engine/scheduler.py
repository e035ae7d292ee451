"""One worker's scheduler: its waiting queue, its running requests, its KV cache, and the
batch of each step.

Modelled on vLLM v1's ``core/sched/scheduler.py``: at every step boundary the scheduler
first finishes the step that ended (:meth:`Scheduler.complete`: positions computed,
tokens emitted, finished requests freed), then chooses the next batch
(:meth:`Scheduler.schedule`): the running requests first, in admission order, then
admissions from the waiting queue by policy. It asks the KV cache manager for blocks and
never changes a block count itself.

Rule 1: a plain request computes ``P + target - 1`` positions in all; the prefill pass
        emits token 1; a preempted request re-prefills ``P + output - 1`` positions
        emitting nothing, then decodes on. A group computes ``P + n * (target - 1)``: the
        prompt once, then ``n`` positions per decode step; after a preemption it
        re-prefills the prompt once (one sequence), then each sequence's ``output - 1``
        positions (``n`` sequences of equal chunks), emitting nothing, then decodes on.
Rule 2: ``max_num_seqs`` caps the running *sequences* and gates admission only: lowering
        it drains, it never evicts. A group is admitted when its ``n`` sequences fit under
        the cap, or when its worker runs nothing at all (so a group wider than the cap
        runs alone instead of waiting forever).
Rule 3: a group is one request to the scheduler: admitted, preempted, aborted and finished
        as a unit (its blocks are freed together); it reports its tokens once per step as
        the count each of its sequences emitted.
Rule 4: when a running request cannot get the blocks its next chunk needs, the scheduler
        preempts a running request not yet in this step's batch (by policy: ``fcfs`` the
        latest admitted; ``priority`` the lowest priority; ``sjf`` / ``ljf`` the one with
        the most tokens left) and tries again; a pass that preempted admits nothing.
Rule 5: one interface, two ways in: a worker running many plain requests takes the fast
        path (:mod:`~inference_lab.core.engine.fast_path`), which chooses and completes a
        step that takes every running request whole in O(1) plus the step's events; any
        other step takes the per-request loop here. Both give the same batch, the same
        integers to the roofline and the same events, to the bit (the scheduler's
        differential tests drive the same workloads both ways).
"""

from __future__ import annotations

import itertools
import math

from inference_lab.core.config import Deployment
from inference_lab.core.engine.block_pool import BlockPool, KVEvent
from inference_lab.core.engine.fast_path import FastBatch, FastPath
from inference_lab.core.engine.kv_cache_manager import KVCacheManager, private_chain
from inference_lab.core.engine.kv_tiers import TierStack
from inference_lab.core.engine.lora import LoraSlots
from inference_lab.core.engine.outputs import WorkerStatistics
from inference_lab.core.engine.request import (
    DONE,
    HELD,
    RECEIVING,
    RUNNING,
    WAITING,
    Request,
    complete_members,
)
from inference_lab.core.engine.scheduler_output import Batch, SchedulerOutput, scheduler_output
from inference_lab.core.engine.wait_queue import WaitQueue
from inference_lab.core.roofline import BatchTerms, Roofline

__all__ = ["Scheduler"]


class Scheduler(FastPath):
    """One worker (replica or data-parallel rank): its queue, running requests, KV cache
    and its step in flight."""

    def __init__(
        self, index: int, dep: Deployment, roofline: Roofline, events: list[KVEvent] | None
    ) -> None:
        sched = dep.scheduler
        self.index = index
        self.roofline = roofline
        self.total_blocks = roofline.total_blocks
        self.pool = BlockPool(self.total_blocks, index, events)
        self.kv = KVCacheManager(
            self.pool,
            sched.block_size,
            sched.enable_prefix_caching,
            blocks_for=roofline.blocks_for,
            room_for=roofline.room_for,
            private=roofline.has_private_blocks(),
        )
        self.max_num_seqs = sched.max_num_seqs
        self.budget = sched.max_num_batched_tokens
        self.chunked = sched.enable_chunked_prefill
        cap = sched.long_prefill_token_threshold
        self.chunk_cap = cap if (self.chunked and cap > 0) else 1 << 62
        self.policy = sched.policy
        self.block_size = sched.block_size
        #: a preempted request without hashes keeps its computed blocks cached (kv Rule 5)
        self.hash_every = sched.enable_prefix_caching and sched.hash_every_prompt
        self.waiting = WaitQueue(sched.policy)
        self.running: list[Request] = []
        self.running_seqs = 0  # sum of n over running
        #: the step in flight's members (empty: idle)
        self.batch: Batch = []
        self.scheduled = False  # a boundary event for this worker is in the calendar
        self.boundary_seq = -1  # the calendar sequence number of that event
        self.admit_order = itertools.count()
        self.step_id = 0
        # The step in flight (when ``batch``): its start, its end, its price's terms, the
        # token budget it left unused and its pass mark, so a late arrival can join it.
        self.step_start = 0.0
        self.step_end = 0.0
        self.step_terms: BatchTerms | None = None
        self.step_budget = 0
        self.step_mark = 0
        #: Speculative decoding (drafting Rule 1): the config, and the step in flight's
        #: batch without drafts (its terms, widths, contexts), its drafting sequences'
        #: contexts and its draft length, which price it and a late arrival joining it.
        self.spec = dep.speculative
        self.step_plain: BatchTerms | None = None
        self.step_pns: list[int] = []
        self.step_cs: list[int] = []
        self.step_dcs: list[int] = []
        self.step_gamma = 0
        #: requests admitted with blocks for a remote prefill's KV, waiting for it (Rule 6)
        self.receiving: list[Request] = []
        #: the receptions started by the last pass, for the engine to file their ends
        self.new_transfers: list[Request] = []
        #: finished requests whose blocks are kept for a remote decode, by id (Rule 6)
        self.held: dict[int, Request] = {}
        #: its tokens are not the client's (a disaggregated deployment's prefill pool)
        self.internal = False
        #: simulated seconds it has spent stepping (its steps' durations, summed)
        self.busy_seconds = 0.0
        #: the KV tiers behind its HBM (None: none configured; kv_tiers Rule 1)
        self.tiers = (
            TierStack(dep, roofline, self.kv, index, events)
            if sched.kv_offloading_size > 0
            else None
        )
        #: its LoRA slots (lora Rules 1-3; None: no [lora]), set by the engine
        self.lora: LoraSlots | None = None
        self.init_fast_path(roofline, allowed=self.spec is None and dep.lora is None)

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
            left = r.prefill_length() - r.num_computed
            if left > 0:
                total += left
        for r in self.waiting:
            total += r.prefill_length()
        return total

    # ------------------------------------------------------------------ admission
    def first_chunk(self, r: Request, budget: int) -> tuple[int, int, int, int] | None:
        """Admitting ``r`` (nothing resident) with ``budget`` tokens left in the step: its
        cached leading blocks, the positions of its first chunk on top of them, the new
        blocks that chunk needs, and the cached blocks it takes off the free queue. None
        when its stage cannot run within ``budget`` (chunked prefill off)."""
        hit, touched = self.kv.computed_blocks(r) if r.cacheable_blocks else (0, 0)
        c = hit * self.block_size
        # the first stage always runs as one sequence (a group's prompt)
        left, _ = self._stage(r, c)
        if left:
            if not self.chunked and left > budget:
                return None
            n = min(left, budget, self.chunk_cap)
        else:
            n = 1  # a preempted request whose whole re-prefill is cached decodes at once
        return hit, n, self.kv.blocks_for(c + n) - hit, touched

    def first_chunk_blocks(self, r: Request) -> int:
        """Free blocks admitting ``r`` takes with a whole step's budget (the admission
        ledger's measure); for a request with a remote prefill, those of its received
        positions and one more (Rule 6)."""
        if r.remote_positions or r.num_blocks:
            positions = max(r.remote_positions, r.num_computed) + 1
            return max(0, self.kv.blocks_for(positions) - r.num_blocks)
        chunk = self.first_chunk(r, self.budget)
        if chunk is None:
            return self.kv.blocks_for(self._stage(r, 0)[0])
        return chunk[2] + chunk[3]

    def admit_head(self, now: float, mark: int, budget: int) -> tuple[Request, int] | None:
        """Admit the head of the waiting queue into a step starting at ``now`` with
        ``budget`` tokens left, if the cap, the budget and the free blocks allow: it runs
        its first prefill chunk there, on top of the prefix its worker has cached (its
        ``num_computed`` on return). Returns (request, positions) or None."""
        r = self._admissible_head(now)
        if r is None:
            return None
        if r.num_blocks:  # its KV arrived: only its next chunk's blocks to find
            return self._admit_resident(r, mark, budget)
        chunk = self._head_chunk(r, budget)
        if chunk is None:
            return None
        hit, n, need, touched = chunk
        if need + touched > self.pool.free:
            return None
        self.enter_running(r, hit, need, now, mark)
        return r, n

    def _admissible_head(self, now: float) -> Request | None:
        """The head of the waiting queue, if the cap lets it in, after the receptions
        it starts (a remote prefill's KV or a fetch from the tiers: Rule 6, those heads
        leave the queue); None when nothing may be admitted now."""
        tiers = self.tiers
        while True:
            r = self.waiting.peek()
            if r is None:
                return None
            if self.running_seqs + r.n > self.max_num_seqs and self.running_seqs:
                return None
            if tiers is not None and not r.tier_checked and not r.num_blocks:
                if not r.remote_positions and r.cacheable_blocks:
                    tiers.plan(r)  # a fetch from the tiers waits as a received KV does
            if not r.remote_positions or r.num_blocks:
                return r
            if not self._receive(r, now):  # a remote prefill's KV or a fetch (Rule 6)
                return None  # its blocks are short: it waits at the head

    def _head_chunk(self, r: Request, budget: int) -> tuple[int, int, int, int] | None:
        """``first_chunk`` of the head ``r`` (nothing resident) within ``budget``: its
        cached blocks, its first chunk's positions, the new blocks and the cached ones
        it takes; a plain request without a prefix in O(1). None: it cannot run now."""
        if r.n == 1 and not r.cacheable_blocks:  # first_chunk of a plain request, no prefix
            n = r.prefill_length()  # its whole (re-)prefill
            if n > budget:
                if not self.chunked:
                    return None
                n = budget
            if n > self.chunk_cap:
                n = self.chunk_cap
            return 0, n, self.kv.blocks_for(n), 0
        return self.first_chunk(r, budget)

    def _receive(self, r: Request, now: float) -> bool:
        """Rule 6: take the blocks of ``r``'s remote prefill positions (beyond what this
        worker has cached of them) and start receiving them: ``r`` leaves the queue,
        RECEIVING, and the engine files its transfer's end. False (nothing changed) when
        the free blocks cannot hold them."""
        hit, touched = self.kv.computed_blocks(r) if r.cacheable_blocks else (0, 0)
        positions = max(r.remote_positions, hit * self.block_size)
        need = self.kv.blocks_for(positions) - hit
        if need + touched > self.pool.free:
            return False
        self.waiting.pop()
        self.kv.admit(r, hit, need, r.first_scheduled_time < 0)
        if r.first_scheduled_time < 0:
            r.first_scheduled_time = now
        r.status = RECEIVING
        self.receiving.append(r)
        self.new_transfers.append(r)
        return True

    def received(self, r: Request) -> None:
        """Rule 6: ``r``'s remote KV arrived: its positions count as computed (the blocks
        they fill are cached like computed ones) and it goes to the head of the queue."""
        self.receiving.remove(r)
        positions = r.remote_positions
        r.remote_positions = 0
        r.tier_fetch = None
        if positions > r.num_computed:
            r.num_computed = positions
            if positions >= r.next_cache_position:
                self.kv.cache_computed(r, positions)
        if not r.preemptions:  # found computed, as vLLM counts external tokens as cached
            r.cached_tokens = max(r.cached_tokens, positions)
        r.status = WAITING
        self.waiting.push_front(r)

    def _admit_resident(self, r: Request, mark: int, budget: int) -> tuple[Request, int] | None:
        """Admit the head ``r``, whose KV is resident already (received from a remote
        prefill), into the step marked ``mark``: its next chunk on top of it, within
        ``budget`` and the free blocks (Rule 6)."""
        left = r.prefill_length() - r.num_computed
        if left <= 0:
            n = 1
        elif not self.chunked and left > budget:
            return None
        else:
            n = min(left, budget, self.chunk_cap)
        if self.kv.allocate(r, r.num_computed + n) is None:
            return None
        self.waiting.pop()
        r.status = RUNNING
        r.admit_order = next(self.admit_order)
        r.batch_mark = mark
        self.running.append(r)
        self.running_seqs += r.n
        return r, n

    def release(self, r: Request) -> None:
        """Rule 6: ``r`` held its blocks for a remote decode; they go back now."""
        del self.held[r.id]
        self.kv.free(r)
        r.status = DONE

    def verify_reserve(self) -> int:
        """Speculative decoding (drafting Rule 1): the blocks the running decoding requests'
        next verify steps take beyond those they hold -- from where the step in flight
        leaves them (its accepted positions are drawn), at the draft length the running
        batch gets. The scheduler grows running requests before it admits any, so an
        admission finds only what is left. O(running)."""
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
            c = r.num_computed + step
            out = r.num_output
            if step and c >= r.prompt_tokens:
                out = min(c - r.prompt_tokens + 1, r.max_tokens)
            if c < r.prompt_tokens + (out - 1 if out > 1 else 0):
                continue  # prefilling: its chunks are what the budget gives
            left = r.max_tokens - out - 1
            width = 1 + (gamma if gamma < left else (left if left > 0 else 0))
            need = self.kv.group_blocks(r, c + width) - r.num_blocks
            if need > 0:
                total += need
        return total

    def _group_chunk(self, r: Request, c: int, budget: int, gamma: int) -> tuple[int, int] | None:
        """A running group's next chunk from ``c`` computed positions within ``budget``:
        (positions per sequence, sequences), or None when the budget cannot hold every
        sequence of it (Rule 1; a verify's width: drafting Rule 1)."""
        left, seqs = self._stage(r, c)
        if left:
            if not self.chunked and left * seqs > budget:
                return None
            n = min(left, budget // seqs, self.chunk_cap)
        else:
            n = 1
            if gamma:
                left = r.max_tokens - r.num_output - 1
                n += gamma if gamma < left else (left if left > 0 else 0)
                if n * seqs > budget:
                    n = max(1, budget // seqs)
        if n * seqs > budget or n == 0:
            return None
        return n, seqs

    def _stage(self, r: Request, c: int) -> tuple[int, int]:
        """The work ``r`` has left in its current stage from ``c`` computed positions:
        (positions per sequence, sequences). A prefill of a plain request is one stage;
        a group's prompt (one sequence) and its re-prefilled outputs (n sequences) are
        two; decoding is one position per sequence."""
        prefill_len = r.prefill_length()
        if c < prefill_len:
            if r.n == 1:
                return prefill_len - c, 1
            if c < r.prompt_tokens:
                return r.prompt_tokens - c, 1
            return prefill_len - c, r.n
        return 0, r.n

    # ------------------------------------------------------------------ preemption
    def _victim(self, current: Request) -> Request:
        """The running request to preempt (Rule 4): among those not yet in this step's
        batch (the current one included), by policy."""
        mark = self.step_id
        candidates = (r for r in self.running if r.batch_mark != mark or r is current)
        if self.policy == "fcfs":
            for r in reversed(self.running):
                if r.batch_mark != mark or r is current:
                    return r
            return current
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.admit_order))
        return max(candidates, key=lambda r: (r.max_tokens - r.num_output, r.admit_order))

    def _preempt_for(self, r: Request, i: int) -> int:
        """The running request ``r`` (row ``i``) found its blocks short: preempt the
        victim (Rule 4). Returns 1 when the victim's row came before ``i`` (the rows
        after it moved up one), else 0."""
        victim = self._victim(r)
        vi = self.running.index(victim)
        self._preempt(victim)
        return 1 if victim is not r and vi < i else 0

    def _preempt(self, r: Request) -> None:
        if self.hash_every and r.n == 1 and not r.block_hashes:  # (kv Rule 5)
            blocks = (r.prompt_tokens + r.max_tokens - 1) // self.block_size
            self.kv.cache_preempted(r, private_chain(r.id, blocks))
        self.kv.free(r)
        r.tier_checked = False
        r.num_computed = 0
        r.preemptions += 1
        r.status = WAITING
        r.batch_mark = -1
        self.running.remove(r)
        self.running_seqs -= r.n
        self.waiting.push_front(r)

    # ------------------------------------------------------------------ a boundary
    def schedule(self, now: float) -> SchedulerOutput:
        """Choose the batch starting at ``now`` (the one interface of Rule 5): running
        first in admission order, then admissions by policy when nothing was preempted.
        Re-runs a pass that preempted and scheduled nothing."""
        if self.fast_allowed:
            chosen = self.schedule_fast(now)
            if chosen is not None:
                return chosen
        total_preempted = 0
        spec = self.spec
        gamma = 0 if spec is None else spec.gamma_for(self.running_seqs)
        self.step_gamma = gamma
        while True:
            self.step_id += 1
            mark = self.step_id
            batch, ns, cs, budget, preempted = self._schedule_running(mark, gamma)
            if not preempted and self.lora is not None:  # (lora Rule 1)
                budget = self.lora.admit(self, now, mark, budget, batch, ns, cs)
            elif not preempted:
                while budget > 0 and self.waiting.count:
                    admitted = self.admit_head(now, mark, budget)
                    if admitted is None:
                        break
                    r, n = admitted
                    batch.append((r, n))
                    ns.append(n)
                    cs.append(r.num_computed)  # its cached prefix, if any
                    budget -= n
            total_preempted += preempted
            if batch or not preempted:
                self.step_budget = budget
                self.step_mark = mark
                return scheduler_output(batch, ns, cs, None, total_preempted)

    def _schedule_running(
        self, mark: int, gamma: int
    ) -> tuple[list[tuple[Request, int]], list[int], list[int], int, int]:
        """One pass over the running requests for the step marked ``mark``: each gets its
        next chunk (a decode position, a verify width, a prefill chunk) within the budget
        and its blocks from the KV cache manager, preempting (Rule 4) when they are short.
        Returns the members, their positions and contexts per sequence, the budget left
        and how many it preempted."""
        budget = self.budget
        chunk_cap = self.chunk_cap
        chunked = self.chunked
        allocate = self.kv.allocate
        batch: list[tuple[Request, int]] = []
        ns: list[int] = []
        cs: list[int] = []
        add_batch, add_n, add_c = batch.append, ns.append, cs.append
        preempted = 0
        running = self.running
        count = len(running)
        i = 0
        while i < count and budget > 0:
            r = running[i]
            c = r.num_computed
            if r.n == 1:  # the plain request: the hot path
                out = r.num_output
                prefill_len = r.prompt_tokens + (out - 1 if out > 1 else 0)
                if c < prefill_len:
                    left = prefill_len - c
                    if not chunked and left > budget:
                        i += 1
                        continue
                    n = min(left, budget, chunk_cap)
                else:  # a decode position, or a verify step's (drafting Rule 1)
                    n = _verify_width(r.max_tokens - out - 1, gamma, budget) if gamma else 1
                seqs = 1
                if c + n <= r.block_room:  # its blocks hold it: nothing to ask
                    r.batch_mark = mark
                    add_batch((r, n))
                    add_n(n)
                    add_c(c)
                    budget -= n
                    i += 1
                    continue
            else:
                chunk = self._group_chunk(r, c, budget, gamma)
                if chunk is None:
                    i += 1  # this step's budget cannot hold every sequence
                    continue
                n, seqs = chunk
            if allocate(r, c + n) is None:
                i -= self._preempt_for(r, i)
                count -= 1
                preempted += 1
                continue
            r.batch_mark = mark
            add_batch((r, n))
            if seqs == 1:
                add_n(n)
                add_c(c)
            else:
                ns.extend([n] * seqs)
                cs.extend([c] * seqs)
            budget -= n * seqs
            i += 1
        return batch, ns, cs, budget, preempted

    def complete(
        self, now: float, emit: list[tuple[int, int]]
    ) -> tuple[tuple[tuple[int, int], ...], list[Request]]:
        """The step in flight ends at ``now``: its members' positions become computed (a
        verify's accepted ones: drafting Rule 1), their tokens emitted, the finished ones
        freed (status DONE, blocks given back). Returns the tokens of its first members
        when the fast path ran it (its decoding rows: one each, which come before those
        it adds to ``emit``), and the requests that finished, in batch order."""
        if type(self.batch) is FastBatch:
            return self.complete_fast(now, emit)
        kv = self.kv
        batch = self.batch
        assert isinstance(batch, list)  # (the fast path's is a FastBatch)
        if kv.pool.filling:  # members whose positions fill blocks their hashes name
            kv.cache_batch(batch)
        done, _ = complete_members(batch, now, emit)
        if not done:
            return (), []
        finished = [batch[i][0] for i in done]
        for r in finished:
            self.finish(r)
        self.running = [r for r in self.running if r.status == RUNNING]
        return (), finished

    def finish(self, r: Request) -> None:
        """``r`` emitted its last token: it is DONE and its blocks go back -- or, holding
        them for a remote decode, HELD with its blocks (Rule 6)."""
        self.running_seqs -= r.n
        if r.hold_kv:
            r.status = HELD
            self.held[r.id] = r
            return
        r.status = DONE
        self.kv.free(r)

    # ------------------------------------------------------------------ state
    def time_to_next_finish(self, now: float, per_step: float) -> float | None:
        """Seconds from ``now`` until the first running request here is expected to
        finish, at the current step time: the rest of the step in flight, then one step
        per prefill chunk and per token it has left (its hidden length, as the simulation
        knows it) -- per ``per_step`` tokens (a verify's mean acceptance length). None
        when nothing runs."""
        if not self.running or not self.batch:
            return None
        self.sync_running()
        step = self.step_end - self.step_start
        chunk = min(self.budget, self.chunk_cap)
        best: float | None = None
        for r in self.running:
            left = max(0, r.prefill_length() - r.num_computed)
            tokens = r.target_tokens - max(r.num_output, 1)
            if per_step != 1.0:
                tokens = math.ceil(tokens / per_step)
            steps = -(-left // chunk) + tokens
            eta = max(0.0, self.step_end - now) + max(0, steps - 1) * step
            if best is None or eta < best:
                best = eta
        return best

    def statistics(self) -> WorkerStatistics:
        pool = self.pool
        return WorkerStatistics(
            waiting=self.waiting.count,
            running=len(self.running),
            running_seqs=self.running_seqs,
            kv_used_blocks=self.total_blocks - pool.free,
            kv_total_blocks=self.total_blocks,
            max_num_seqs=self.max_num_seqs,
            prefix_cache_queries=pool.queries,
            prefix_cache_hits=pool.hits,
            cached_blocks=pool.cached_blocks,
            receiving=len(self.receiving),
            held=len(self.held),
            busy_seconds=self.busy_seconds,
            tiers=None if self.tiers is None else self.tiers.statistics(),
            lora=None if self.lora is None else self.lora.statistics(self.running, self.waiting),
        )


def _verify_width(left: int, gamma: int, budget: int) -> int:
    """A decoding request's verify step (drafting Rule 1): 1 + gamma positions, gamma
    capped by the ``left`` tokens after the next one (``max_tokens - output - 1``) and
    the width by the ``budget``."""
    n = 1 + (gamma if gamma < left else (left if left > 0 else 0))
    return budget if n > budget else n
