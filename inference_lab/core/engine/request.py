"""A request as the engine keeps it: the caller's :class:`RequestSpec`, its status and its
progress.

A request is a **group** of ``n`` sequences (``n`` choices of one prompt; ``n = 1`` is a
plain request), modelled on vLLM's parallel sampling with prefix sharing: the prompt is
prefilled once, as one sequence, and its KV blocks are shared; from the pass that
completes it the ``n`` sequences decode together, each a batch member.

Rule 1: a request's status only moves forward, PENDING -> WAITING -> RUNNING -> DONE,
        except that a preemption moves it from RUNNING back to WAITING (it re-prefills);
        a request with a remote prefill goes WAITING -> RECEIVING -> WAITING (its KV
        arrived) first, and one that holds its KV for a remote decode finishes HELD, then
        DONE when it is released.
Rule 2: ``num_computed`` and ``num_output`` count positions and tokens *per sequence*; a
        running plain request in the scheduler's fast path keeps them lazily
        (``lazy_base``: :mod:`~inference_lab.core.engine.running_rows` Rule 4) and they are
        written back before anything else reads them.
Rule 3: the block fields (``num_blocks``, ``block_room``, the cache fields) are changed
        only by the KV cache manager (:mod:`~inference_lab.core.engine.kv_cache_manager`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import attrs

from inference_lab.core.engine.block_pool import NOT_CACHED
from inference_lab.core.engine.outputs import Finished, finished_record

__all__ = [
    "DONE",
    "HELD",
    "PENDING",
    "RECEIVING",
    "RUNNING",
    "WAITING",
    "Request",
    "RequestSpec",
    "RequestStatus",
    "complete_members",
]


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
    #: when it finishes, keep its KV blocks for a remote decode (a prefill server's
    #: ``do_remote_decode``) until :meth:`Engine.release_kv` or the engine's own hand-off
    hold_kv: bool = False
    #: positions whose KV a remote prefill computed (a decode server's
    #: ``do_remote_prefill``): admitted, they are received over the link, then computed
    remote_positions: int = 0
    #: the LoRA adapter it runs with, by name (None: the base model; docs/lora.md)
    lora: str | None = None
    #: the session (or closed-loop user) it belongs to, for the ``session_affinity``
    #: router (None: none)
    session: int | None = None


class RequestStatus(enum.IntEnum):
    """Where a request is (Rule 1)."""

    #: submitted; its arrival event not handled yet
    PENDING = 0
    #: in its worker's waiting queue (new or preempted)
    WAITING = 1
    #: admitted: holds KV blocks and is in its worker's running list
    RUNNING = 2
    #: finished or aborted
    DONE = 3
    #: admitted with blocks for a remote prefill's KV, waiting for it to arrive
    RECEIVING = 4
    #: finished with its blocks kept for a remote decode (``hold_kv``)
    HELD = 5


# module-level names for the hot paths (an enum member lookup costs a class attribute)
PENDING = RequestStatus.PENDING
WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
DONE = RequestStatus.DONE
RECEIVING = RequestStatus.RECEIVING
HELD = RequestStatus.HELD


class Request:
    """One submitted request (group) and its progress. Built by the engine only."""

    __slots__ = (
        "id",
        "n",
        "prompt_tokens",
        "max_tokens",
        "target_tokens",
        "priority",
        "arrival_time",
        "stamped_time",
        "routed_worker",
        "num_computed",
        "num_output",
        "first_token_time",
        "first_scheduled_time",
        "preemptions",
        "num_blocks",
        "block_room",
        "status",
        "worker",
        "batch_mark",
        "admit_order",
        "queue_key",
        "block_hashes",
        "cacheable_blocks",
        "held_hashes",
        "next_cache_position",
        "cached_tokens",
        "lazy_base",
        "hold_kv",
        "remote_positions",
        "tier_fetch",
        "tier_checked",
        "lora",
        "lora_name",
        "session",
    )

    def __init__(
        self, rid: int, spec: RequestSpec, arrival: float, target: int, stamp: float
    ) -> None:
        self.id = rid
        self.n = spec.n
        self.prompt_tokens = spec.prompt_tokens
        self.max_tokens = spec.max_tokens
        #: where each sequence really stops (hidden from the scheduler)
        self.target_tokens = target
        self.priority = spec.priority
        #: when it entered the engine: ``max(stamped_time, now)`` at submission
        self.arrival_time = arrival
        #: the caller's arrival time plus the frontend latency (may precede arrival_time)
        self.stamped_time = stamp
        #: the worker the caller routed it to, if it did
        self.routed_worker = spec.worker
        #: its session, for the ``session_affinity`` router
        self.session = spec.session
        #: positions computed per sequence (its KV written); tokens emitted per sequence
        self.num_computed = 0
        self.num_output = 0
        self.first_token_time = -1.0
        self.first_scheduled_time = -1.0
        self.preemptions = 0
        #: KV blocks held; the positions they surely hold (a plain request; 0: ask)
        self.num_blocks = 0
        self.block_room = 0
        self.status = PENDING
        self.worker = -1
        #: the scheduler pass whose batch holds it (-1: none)
        self.batch_mark = -1
        #: admission order on its worker (preemption picks by it)
        self.admit_order = 0
        #: a heap policy's sort key in the waiting queue
        self.queue_key: tuple[Any, ...] = ()
        self.block_hashes = spec.block_hashes
        # the prefix-cache fields, set by KVCacheManager.prepare when it is submitted:
        #: how many of its hashes may ever be cached; the cached ones it holds; the
        #: position at which its next block becomes cacheable; its first admission's hit
        self.cacheable_blocks = 0
        self.held_hashes: list[int] | tuple[int, ...] = ()
        self.next_cache_position = NOT_CACHED
        self.cached_tokens = 0
        #: decoding in the fast path: ``num_computed`` minus the rows' decode counter
        self.lazy_base = 0
        self.hold_kv = spec.hold_kv
        #: positions still to be received from a remote prefill (0 once received)
        self.remote_positions = spec.remote_positions
        #: the fetch from the KV tiers behind HBM it waits for: blocks from the host, from
        #: the disk, seconds (None: none); whether this admission has looked at the tiers
        self.tier_fetch: tuple[int, int, float] | None = None
        self.tier_checked = False
        #: its LoRA adapter's id and name (0, None: the base model; set by the engine)
        self.lora = 0
        self.lora_name: str | None = None

    def report(self, finish_time: float, worker: int, frontend_latency: float) -> Finished:
        """The ``Finished`` record of this request, which ended at ``finish_time`` on
        ``worker``; its arrival is the caller's, before ``frontend_latency`` (engine
        Rule 7)."""
        return finished_record(
            request_id=self.id,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.num_output,
            finish_reason="length" if self.num_output >= self.max_tokens else "stop",
            arrival_time=(
                self.arrival_time - frontend_latency if frontend_latency else self.arrival_time
            ),
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finish_time=finish_time,
            preemptions=self.preemptions,
            n=self.n,
            cached_tokens=self.cached_tokens,
            worker=worker,
        )

    def finished_fields(
        self, finish_time: float, worker: int, frontend_latency: float
    ) -> tuple[Any, ...]:
        """The first twelve fields of the ``Finished`` :meth:`report` gives, in their
        order, without the object (a run's recorder: ``Engine.run_until``'s ``record``)."""
        out = self.num_output
        return (
            self.id,
            self.prompt_tokens,
            out,
            "length" if out >= self.max_tokens else "stop",
            self.arrival_time - frontend_latency if frontend_latency else self.arrival_time,
            self.first_scheduled_time,
            self.first_token_time,
            finish_time,
            self.preemptions,
            self.n,
            self.cached_tokens,
            worker,
        )

    def prefill_length(self) -> int:
        """Positions per sequence it must have computed before it decodes: the prompt, and
        after a preemption the outputs it re-prefills (all but the last)."""
        out = self.num_output
        return self.prompt_tokens + (out - 1 if out > 1 else 0)


def complete_members(
    members: Sequence[tuple[Request, int]], now: float, emit: list[tuple[int, int]]
) -> tuple[list[int], int]:
    """The step ending at ``now`` computed ``n`` more positions of each running member
    ``(r, n)``: its ``num_computed`` moves on and, past its prefill, its tokens are
    emitted (``emit`` gets ``(id, count)``; a first token stamps ``first_token_time``).
    Returns the indices of the members whose last token that was, and the index of the
    first member that emitted nothing (``len(members)`` if all did). Members no longer
    running (aborted or preempted while the step was in flight) are skipped. The one
    completion arithmetic of the scheduler's two ways in (its Rule 5)."""
    done: list[int] = []
    still = len(members)
    add = emit.append
    for i, (r, n) in enumerate(members):
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
                add((r.id, new - out))
                r.num_output = new
                if new >= r.target_tokens:
                    done.append(i)
                continue
        if still == len(members):
            still = i
    return done, still
